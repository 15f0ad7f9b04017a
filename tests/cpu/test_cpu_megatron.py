"""verl's Megatron engine on CPU (``+device=cpu_megatron model_engine=megatron``): the preset, its refusals, the
patches, and the pieces of an end-to-end run one by one.

The end-to-end runs are elsewhere: R2 with expert parallel 2 (route drift, the run guard's stop, the checkpoint and
an exact resume) in tests/cpu/test_cpu_megatron_resume.py; R3, and the non-finite stop on the Megatron engine, with
verl's vLLM server as the sampler (tests/cpu/test_cpu_vllm.py): its routes go through the same agent loop, alignment
and padded layout as the hf_cpu server's, whose recording is checked against a full forward below.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import compose

from respo_verl.cpu.preset import MEGATRON_CPU_SETTINGS, CPUJobError, check_cpu_job, is_cpu_job
from respo_verl.entry_points import CPU_MODULE, PLUGIN_MODULE
from respo_verl.main_ppo import check
from respo_verl.patches import mbridge_0_15_1, verl_0_9_1

MEGATRON_JOB = ["algorithm=respo", "routing=r2", "model_engine=megatron", "+device=cpu_megatron"]


def test_local_layer_names_map_to_the_names_of_mbridges_tables():
    te_name = mbridge_0_15_1.te_name
    assert (
        te_name("decoder.layers.1.input_layernorm.weight")
        == "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    )
    assert te_name("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight") == (
        "decoder.layers.0.mlp.experts.linear_fc1.weight3"
    )
    assert te_name("decoder.layers.0.mlp.experts.local_experts.12.linear_fc2.weight") == (
        "decoder.layers.0.mlp.experts.linear_fc2.weight12"
    )
    for unchanged in (
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.final_layernorm.weight",
        "embedding.word_embeddings.weight",
    ):
        assert te_name(unchanged) == unchanged


@pytest.fixture
def fp32_megatron_config():
    """verl's McoreEngineConfig accepting fp32, as the CPU runtime makes it in every process of the job; undone after
    the test (this pytest process also runs non-CPU tests)."""
    patch = verl_0_9_1.FP32_MEGATRON_CONFIG
    applied_here = patch.apply()
    yield patch
    if applied_here:
        patch.remove()


@pytest.mark.parametrize("entry", ["respo", "verl"])
def test_preset_composes_and_passes_the_checks_and_verls_validation(entry, fp32_megatron_config):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    job = MEGATRON_JOB if entry == "respo" else ["+" + MEGATRON_JOB[0], "+" + MEGATRON_JOB[1], *MEGATRON_JOB[2:]]
    cfg = compose(job, entry=entry)
    assert is_cpu_job(cfg)
    check(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert (actor.strategy, actor.engine.dtype, actor.engine.router_replay.mode) == ("megatron", "fp32", "R2")
    assert (actor.engine.use_mbridge, actor.engine.vanilla_mbridge) == (True, True)
    modules = cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES.split(",")
    assert modules == [CPU_MODULE, PLUGIN_MODULE]
    assert cfg.actor_rollout_ref.model.path.endswith("/moe/model")


def test_verl_refuses_fp32_megatron_configs_without_the_patch():
    """The patch is needed: verl 0.9.1's McoreEngineConfig asserts bf16/fp16 (checked on a fresh class)."""
    import dataclasses

    from verl.workers.config.engine import McoreEngineConfig

    patch = verl_0_9_1.FP32_MEGATRON_CONFIG
    original = vars(McoreEngineConfig)["__post_init__"]
    if patch.applied:  # another test of this process applied it: check verl's own method
        patch.remove()
        original = vars(McoreEngineConfig)["__post_init__"]
        patch.apply()
    fields = {f.name: f.default for f in dataclasses.fields(McoreEngineConfig) if f.init}
    config = object.__new__(McoreEngineConfig)
    for name, value in fields.items():
        if value is not dataclasses.MISSING:
            object.__setattr__(config, name, value)
    object.__setattr__(config, "dtype", "fp32")
    with pytest.raises(AssertionError, match="dtype fp32 not supported"):
        original(config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+device=cpu", "model_engine=megatron"], "needs +device=cpu_megatron together with model_engine=megatron"),
        (["+device=cpu_megatron"], "needs +device=cpu_megatron together with model_engine=megatron"),
    ],
)
def test_engine_and_preset_must_match(overrides, message):
    with pytest.raises(CPUJobError, match=re.escape(message)):
        check_cpu_job(compose(overrides))


R3_JOB = [MEGATRON_JOB[0], "routing=r3", *MEGATRON_JOB[2:]]


def test_rollout_routing_replay_composes_and_passes_the_checks():
    cfg = compose(R3_JOB)
    check_cpu_job(cfg)
    assert cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay is True
    assert cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "R3"


@pytest.fixture(scope="module")
def moe_kit():
    from respo_verl.cpu.kit.build import KitSpec, build_kit

    return build_kit(KitSpec(moe=True), progress=False)


def _rollout_server(model_path, r3: bool):
    from omegaconf import OmegaConf

    from respo_verl.cpu.rollout import CPURolloutServer

    config = OmegaConf.create(
        {
            "prompt_length": 8,
            "response_length": 12,
            "seed": 0,
            "engine_kwargs": {},
            "enable_rollout_routing_replay": r3,
        }
    )
    return CPURolloutServer(config, OmegaConf.create({"path": str(model_path)}))


def test_rollout_server_returns_the_routes_of_every_token_it_fed_to_the_model(moe_kit):
    """R3's input: (prompt + response - 1, layers, top-k), the routes a full forward of those tokens chooses."""
    import asyncio

    from respo_verl.routing.hf import RoutingReplay

    server = _rollout_server(moe_kit.model, r3=True)
    prompt = [5, 9, 11, 7, 3]
    out = asyncio.run(
        server.generate(prompt, {"temperature": 1.0, "ignore_eos": True, "max_tokens": 6, "logprobs": 1}, "r0")
    )
    fed = prompt + out.token_ids[:-1]
    layers, top_k = server.model.config.num_hidden_layers, server.model.config.num_experts_per_tok
    assert out.routed_experts.shape == (len(fed), layers, top_k) and str(out.routed_experts.dtype) == "int16"
    with torch.no_grad(), RoutingReplay(_rollout_server(moe_kit.model, r3=False).model) as replay:
        with replay.record() as routes:
            replay.model(input_ids=torch.tensor([fed]))
    full = torch.stack([routes[layer] for layer in replay.layers], dim=1)  # (tokens, L, K)
    assert torch.equal(torch.from_numpy(out.routed_experts).long(), full)
    plain = asyncio.run(_rollout_server(moe_kit.model, r3=False).generate(prompt, {"max_tokens": 3}, "r1"))
    assert plain.routed_experts is None


def test_rollout_routing_replay_on_a_dense_model_names_the_option():
    from respo_verl.cpu.kit.build import KitSpec, build_kit

    dense = build_kit(KitSpec(), progress=False)
    with pytest.raises(ValueError, match=r"enable_rollout_routing_replay=true .* needs an MoE model"):
        _rollout_server(dense.model, r3=True)


@pytest.mark.parametrize("where", ["shell", "runtime_env"])
def test_transformer_engine_attention_switches_left_on_are_refused_naming_the_variable(where, monkeypatch):
    """megatron-core asserts on NVTE_FLASH_ATTN=1 deep in a Ray worker; the preflight says it first."""
    overrides = list(MEGATRON_JOB)
    if where == "shell":
        monkeypatch.setenv("NVTE_FLASH_ATTN", "1")
    else:
        overrides.append("+ray_kwargs.ray_init.runtime_env.env_vars.NVTE_FUSED_ATTN='1'")
    name = "NVTE_FLASH_ATTN" if where == "shell" else "NVTE_FUSED_ATTN"
    with pytest.raises(CPUJobError, match=re.escape(f"{name}=1 in ") + ".*conflicts with the local attention"):
        check_cpu_job(compose(overrides))
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")  # what megatron-core itself sets for the local backend
    check_cpu_job(compose(list(MEGATRON_JOB)))


def test_routes_of_a_padded_batch_are_laid_out_as_its_routers_see_them_and_back():
    from respo_verl.patches.verl_0_9_1 import per_sample_routes, seq_major_routes

    # two samples of 3 and 1 tokens, 1 layer, top-1: expert ids 10, 11, 12 and 20
    routes = torch.nested.as_nested_tensor(
        [torch.tensor([[[10]], [[11]], [[12]]]), torch.tensor([[[20]]])], layout=torch.jagged
    )
    rows, valid = seq_major_routes(routes)  # token (s, b) at row s * batch + b
    assert rows.flatten().tolist() == [10, 20, 11, 0, 12, 0]
    assert valid.tolist() == [True, True, True, False, True, False]
    back = per_sample_routes(rows, torch.tensor([3, 1]))
    assert [t.flatten().tolist() for t in back.unbind()] == [[10, 11, 12], [20]]
    from_offsets = torch.nested.nested_tensor_from_jagged(
        torch.tensor([10, 11, 12, 20]).reshape(4, 1, 1), offsets=torch.tensor([0, 3, 4])
    )  # how verl hands routes to the replay
    assert torch.equal(seq_major_routes(from_offsets)[0], rows)
    with pytest.raises(ValueError, match="recorded 5 routes, expected 3 x 2"):
        per_sample_routes(rows[:5], torch.tensor([3, 1]))


@pytest.mark.parametrize("role", ["actor", "ref"])
@pytest.mark.parametrize("key", sorted(MEGATRON_CPU_SETTINGS))
def test_megatron_settings_that_cannot_run_on_cpu_are_refused_naming_the_key(role, key):
    value = MEGATRON_CPU_SETTINGS[key][0]
    other = {True: "false", False: "true", "fp32": "bfloat16", "local": "flash"}[value]
    full_key = f"actor_rollout_ref.{role}.megatron.{key}"
    with pytest.raises(
        CPUJobError,
        match=re.escape(f"{full_key}={other}").replace("true", "[Tt]rue").replace("false", "[Ff]alse")
        + " does not run on CPU",
    ):
        check_cpu_job(compose([*MEGATRON_JOB, f"{full_key}={other}"]))


def test_exported_expert_weights_become_the_rollout_models_fused_experts(moe_kit):
    """The checkpoint layout mbridge exports, fused, equals transformers' in-memory Qwen3-MoE exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from respo_verl.cpu.rollout import fuse_expert_weights

    model_dir = moe_kit.model
    checkpoint = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        checkpoint.update(load_file(path))
    assert any(".mlp.experts.0.gate_proj.weight" in name for name in checkpoint)  # the per-expert layout
    fused = dict(fuse_expert_weights(checkpoint.items()))
    own = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(fused) == set(own)
    for name, tensor in own.items():
        assert torch.equal(fused[name], tensor), name
    incomplete = {k: v for k, v in checkpoint.items() if ".experts.3.up_proj" not in k}
    with pytest.raises(ValueError, match="the exported experts are incomplete"):
        dict(fuse_expert_weights(incomplete.items()))


def test_verls_padding_mask_becomes_a_causal_mask_for_megatrons_local_attention_and_back():
    from respo_verl.patches.verl_0_9_1 import local_attention_mask, padding_mask

    valid = torch.tensor([[True, True, True], [True, True, False]])  # (B, S): real tokens, then padding
    masked = local_attention_mask(valid)  # (B, 1, S, S), True = masked
    assert masked.shape == (2, 1, 3, 3)
    future = torch.tensor([[False, True, True], [False, False, True], [False, False, False]])
    assert torch.equal(masked[0, 0], future)
    assert torch.equal(masked[1, 0, :2], future[:2] | torch.tensor([False, False, True]))  # padded key never seen
    assert masked[1, 0, 2].all()  # the padded query sees nothing (its output is dropped)
    assert torch.equal(padding_mask(masked), valid)
    full = torch.zeros(2, 1, 3, 3, dtype=torch.bool)
    assert local_attention_mask(full) is full and padding_mask(valid) is valid


def test_cpu_gradient_clipping_scales_like_megatrons_and_refuses_non_fp32_gradients():
    from respo_verl.patches.megatron_core_0_16_1 import _clip_grad_by_total_norm_fp32

    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # total norm 5
    _clip_grad_by_total_norm_fp32(params, max_norm=10.0, total_norm=5.0)  # coefficient >= 1: unchanged
    assert params[0].grad.tolist() == [3.0, 0.0] and params[1].grad.tolist() == [4.0]
    _clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=5.0)
    assert torch.allclose(torch.cat([p.grad for p in params]), torch.tensor([3.0, 0.0, 4.0]) / (5.0 + 1e-6))
    half = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
    half.grad = torch.ones(1, dtype=torch.bfloat16)
    params.append(half)
    with pytest.raises(TypeError, match="expects fp32 gradients"):
        _clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=5.0)


def test_all_to_all_split_sizes_leave_the_dispatcher_as_numpy_on_cpu_as_on_a_gpu():
    """Expert parallelism > 1: torch's all_to_all_single takes numpy size lists, not CPU tensors."""
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher

    from respo_verl.patches.megatron_core_0_16_1 import _host_copy

    original = token_dispatcher.maybe_move_tensor_to_cpu
    assert torch.is_tensor(original(torch.tensor([61, 59]), as_numpy=True))  # what megatron-core does on a CPU
    host = _host_copy(original)
    splits = host(torch.tensor([61, 59]), as_numpy=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [61, 59]
    counts = torch.tensor([3, 4])
    assert host(counts) is counts  # not asked for numpy: unchanged, as megatron-core leaves it
