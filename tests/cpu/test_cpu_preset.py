"""The ``+device=cpu`` preset without running a job: composition, verl's validation, refusals, kit, patches, sampler.

The end-to-end runs are in ``test_cpu_trainer.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import compose
from omegaconf import OmegaConf

from respo_verl.cpu.kit import task
from respo_verl.cpu.kit.build import KitSpec, build_kit
from respo_verl.cpu.kit.reward import compute_score
from respo_verl.cpu.preset import CPUJobError, check_cpu_job, is_cpu_job
from respo_verl.entry_points import CPU_MODULE, PLUGIN_MODULE
from respo_verl.main_ppo import check

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TORCH_COMPILE_DISABLE": "1"}


@pytest.mark.parametrize("entry", ["respo", "verl"])
@pytest.mark.parametrize("algorithm", ["respo", "vespo", "grpo", "gspo"])
def test_preset_composes_and_passes_verls_validation(entry, algorithm):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    choice = f"algorithm={algorithm}" if entry == "respo" else f"+algorithm={algorithm}"
    cfg = compose([choice, "+device=cpu"], entry=entry)
    assert is_cpu_job(cfg)
    check(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert (actor.strategy, rollout.name, cfg.trainer.device) == ("fsdp2", "hf_cpu", "cpu")
    modules = cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES.split(",")
    assert modules == [PLUGIN_MODULE, CPU_MODULE]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.device=cpu"], "trainer.device=cpu needs the CPU preset: add +device=cpu"),
        (["+device=cpu", "model_engine=megatron"], "needs +device=cpu_megatron together with model_engine=megatron"),
        (
            ["+device=cpu", "actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2"],
            "flash_attention_2 does not run on CPU",
        ),
        (
            [
                "+device=cpu",
                "ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=respo_verl.verl.plugin",
            ],
            f"must name {CPU_MODULE}",
        ),
        (["+device=cpu", "trainer.device=cuda"], "runs on the CPU only"),
        (
            ["+device=cpu", "trainer.n_gpus_per_node=2"],
            "= 2 worker processes, but ray_kwargs.ray_init.num_gpus=1",
        ),
    ],
)
def test_jobs_the_cpu_path_cannot_run_are_refused(overrides, message):
    cfg = compose(overrides)
    with pytest.raises(CPUJobError, match=re.escape(message)):
        check_cpu_job(cfg)


def test_a_model_with_an_odd_head_size_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 60, "num_attention_heads": 4, "head_dim": 15}))
    cfg = compose(["+device=cpu", f"actor_rollout_ref.model.path={tmp_path}"])
    with pytest.raises(CPUJobError, match="head_dim=15 is odd"):
        check_cpu_job(cfg)


def test_a_gpu_job_is_not_a_cpu_job():
    cfg = compose([])
    assert not is_cpu_job(cfg)
    check_cpu_job(cfg)  # nothing to refuse


def test_refusals_come_before_ray_as_one_line_also_under_cfg_job(tmp_path):
    from support.entry import run_entry

    for args in (["trainer.device=cpu"], ["+device=cpu", "actor_rollout_ref.actor.policy_loss.respo.alpha_pos=0.5"]):
        for extra in ([], ["--cfg", "job"]):
            proc = run_entry([*args, *extra], tmp_path)
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
            assert "Traceback" not in proc.stderr and "ray init" not in proc.stdout


def test_kit_is_deterministic_and_its_reward_matches_the_task(tmp_path):
    spec = KitSpec(warm_start_steps=3, train_prompts=8, val_prompts=4)
    first, second = (
        build_kit(spec, root=tmp_path / "a", progress=False),
        build_kit(spec, root=tmp_path / "b", progress=False),
    )
    read = [(k.model / "model.safetensors").read_bytes() for k in (first, second)]
    assert read[0] == read[1]
    assert first.info()["key"] == spec.key() != KitSpec(warm_start_steps=4).key()
    assert build_kit(spec, root=tmp_path / "a", progress=False).root == first.root  # cached, not rebuilt
    import pandas as pd

    row = pd.read_parquet(first.train_files).iloc[0]
    assert row["data_source"] == task.DATA_SOURCE and row["reward_model"]["style"] == "rule"
    problem = task.Problem(17, 25)
    assert compute_score(task.DATA_SOURCE, problem.response, problem.answer) == 1.0
    assert compute_score(task.DATA_SOURCE, "#### 41", problem.answer) == -1.0
    assert compute_score(task.DATA_SOURCE, "42", problem.answer) == -1.0  # no answer mark
    with pytest.raises(ValueError, match="scores only"):
        compute_score("openai/gsm8k", "#### 42", "42")


@pytest.mark.slow  # a fresh interpreter that imports verl (10-17 s)
def test_cpu_activation_switches_platform_backend_and_rollout_in_a_fresh_process():
    code = """
import os, torch.distributed as dist
import respo_verl.cpu.activate
from verl.utils.device import get_device_name, get_nccl_backend
from verl.utils import distributed
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import get_rollout_replica_class
from verl.workers.engine.base import EngineRegistry
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
distributed.initialize_global_process_group_ray()
print(get_device_name(), get_nccl_backend(), dist.get_backend(), get_rollout_class("hf_cpu").__name__,
      get_rollout_replica_class("hf_cpu").__name__, EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # torch reports the backend of a device-typed process group as "<device>:<backend>"
    assert proc.stdout.split() == [
        "cpu",
        "gloo",
        "cpu:gloo",
        "CPURolloutAdapter",
        "CPURolloutReplica",
        "FSDPEngineWithLMHead",
    ]


@pytest.mark.slow  # a fresh interpreter that imports verl (10-17 s)
def test_importing_the_package_and_plugin_applies_nothing_in_a_fresh_process():
    code = """
import verl, respo_verl.verl.plugin, sys
from verl.workers.rollout.base import _ROLLOUT_REGISTRY
print("respo_verl.cpu.activate" in sys.modules, ("hf_cpu", "async") in _ROLLOUT_REGISTRY)
"""
    env = {k: v for k, v in ENV.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "False"]


def test_sampler_log_probs_are_the_tempered_distributions_and_truncation_only_restricts_the_draw():
    from respo_verl.cpu.rollout import _sample

    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    gen = torch.Generator().manual_seed(0)
    token, log_prob = _sample(logits, temperature=0.7, top_p=1.0, top_k=-1, generator=gen)
    assert log_prob == pytest.approx(float(torch.log_softmax(logits / 0.7, -1)[token]), abs=1e-6)
    draws = {_sample(logits, 1.0, 1.0, 1, gen)[0] for _ in range(20)}
    assert draws == {0}  # top-k = 1
    draws = {_sample(logits, 1.0, 0.5, -1, gen)[0] for _ in range(20)}
    assert draws == {0}  # p(token 0) > 0.5: the nucleus is one token
    token, log_prob = _sample(logits, 0.0, 1.0, -1, gen)
    assert token == 0 and log_prob == pytest.approx(float(torch.log_softmax(logits, -1)[0]))


def test_rollout_server_loads_only_complete_matching_weight_updates():
    from respo_verl.cpu.rollout import CPURolloutServer

    kit = build_kit(KitSpec(), progress=False)
    config = OmegaConf.create({"prompt_length": 8, "response_length": 12, "seed": 0})
    server = CPURolloutServer(config, OmegaConf.create({"path": str(kit.model)}))
    state = {name: torch.zeros_like(p) for name, p in server.model.named_parameters()}
    assert server.update_weights(state, global_steps=3) == len(state)
    assert all(float(p.detach().abs().sum()) == 0.0 for p in server.model.parameters())
    assert server.global_steps == 3
    name = next(iter(state))
    with pytest.raises(ValueError, match="missing"):
        server.update_weights({k: v for k, v in state.items() if k != name})
    with pytest.raises(ValueError, match="shape"):
        server.update_weights({**state, name: torch.zeros(1)})


def test_deterministic_rollout_samples_by_request_not_by_arrival_order():
    """verl's ``rollout.full_determinism`` names requests ``det-<priority>`` (one per sample); the server's draws then
    depend on (seed, step, request id) only, so request order, which the agent loop does not fix, no longer matters."""
    import asyncio

    from respo_verl.cpu.rollout import CPURolloutServer

    kit = build_kit(KitSpec(), progress=False)
    config = OmegaConf.create({"prompt_length": 8, "response_length": 12, "seed": 5, "full_determinism": True})
    prompt = [1, 2, 3, 4]
    # a hot temperature: the tiny model's draws after these four tokens are then far from certain
    params = {"temperature": 4.0, "top_p": 1.0, "logprobs": True}

    async def serve(server, order, step=1):
        await server.set_global_steps(step)
        outputs = await asyncio.gather(*(server.generate(prompt, params, f"det-{i}") for i in order))
        return {i: (out.token_ids, out.log_probs) for i, out in zip(order, outputs, strict=True)}

    async def main():
        first = await serve(CPURolloutServer(config, OmegaConf.create({"path": str(kit.model)})), [0, 1, 2, 3])
        other = CPURolloutServer(config, OmegaConf.create({"path": str(kit.model)}))
        return first, await serve(other, [3, 1, 0, 2]), await serve(other, [0, 1, 2, 3], step=2)

    first, reordered, next_step = asyncio.run(main())
    assert reordered == first
    assert len({tuple(tokens) for tokens, _ in first.values()}) > 1  # one prompt, different samples per request
    assert next_step != first  # another step draws anew
