"""Known-bad layouts are rejected with the right rule, from composed overrides and from edited layouts."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest

from respo_verl.layout.models import QWEN3_1P7B, QWEN3_30B_A3B
from respo_verl.layout.parallel import Layout
from respo_verl.layout.rules import check_layout
from respo_verl.tools.plan.cli import plan
from respo_verl.tools.plan.memory import estimate_memory, memory_violations
from respo_verl.tools.plan.presets import H100_80GB_GIB

MG = "actor_rollout_ref.actor.megatron"


def _rules(preset, *overrides):
    _, _, violations, _ = plan(preset, list(overrides))
    return {v.rule for v in violations}


def test_verls_own_one_node_example_is_rejected_for_its_expert_grid():
    # verl's Qwen3-30B-A3B example on 1x8: TP 4, EP 2, PP 2, expert TP left null (= TP): grid 4*2*2 = 16 > 8.
    rules = _rules(
        "qwen3_30b_a3b_h100_1x8",
        f"{MG}.tensor_model_parallel_size=4",
        f"{MG}.expert_model_parallel_size=2",
        f"{MG}.pipeline_model_parallel_size=2",
        f"{MG}.expert_tensor_parallel_size=null",
    )
    assert "expert-grid" in rules
    assert "world-grid" not in rules  # TP*PP = 8 divides the node: only the expert grid is wrong


def test_one_node_h100_without_the_cpu_optimizer_does_not_fit():
    rules = _rules(
        "qwen3_30b_a3b_h100_1x8", "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=false"
    )
    assert "memory-train" in rules


@cache
def _base(model: str) -> Layout:
    preset = "qwen3_30b_a3b_h100_2x8" if model == "moe" else "qwen3_1p7b_h100_1x8"
    lay, _, violations, _ = plan(preset)
    assert not violations
    return lay


@pytest.mark.parametrize(
    "model, changes, rule",
    [
        ("moe", {"ep": 3}, "experts-ep"),
        ("moe", {"tp": 3}, "heads-tp"),
        ("moe", {"tp": 3}, "kv-groups-tp"),
        ("moe", {"tp": 3}, "world-grid"),
        ("moe", {"pp": 2, "vpp": 5}, "layers-pp"),
        ("moe", {"pp": 5}, "layers-pp"),
        ("moe", {"vpp": 2}, "vpp-needs-pp"),
        ("moe", {"pp": 2, "vpp": 2, "overlap_p2p_comm": False}, "pp2-vpp-p2p"),
        ("moe", {"sequence_parallel": False}, "moe-sequence-parallel"),
        ("moe", {"recompute_method": None}, "recompute"),
        ("moe", {"recompute_num_layers": 49}, "recompute"),
        ("moe", {"moe_dispatcher": "deepep"}, "moe-dispatcher"),
        ("moe", {"moe_router_dtype": "bf16"}, "router-dtype"),
        ("moe", {"ppo_mini_batch_size": 48}, "batch-mini"),
        ("moe", {"ppo_mini_batch_size": 3, "train_batch_size": 9, "rollout_n": 1}, "batch-dp"),
        ("moe", {"use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": 3}, "batch-micro"),
        ("moe", {"ppo_max_token_len_per_gpu": 8192}, "token-budget"),
        ("moe", {"rollout_tp": 3}, "rollout-tp-node"),
        ("moe", {"rollout_tp": 3}, "rollout-heads"),
        ("moe", {"rollout_ep": 2}, "rollout-ep"),
        ("moe", {"rollout_memory_fraction": 1.0}, "rollout-memory"),
        ("moe", {"rollout_max_model_len": 4096}, "rollout-max-len"),
        ("moe", {"param_offload": False, "optimizer_offload": False}, "memory-rollout"),
        ("moe", {"ppo_max_token_len_per_gpu": 131072}, "memory-train"),
        ("moe", {"log_prob_max_token_len_per_gpu": 262144}, "memory-logprob"),
        ("moe", {"rollout_tp": 1, "rollout_memory_fraction": 0.72}, "rollout-kv"),
        ("dense", {"ulysses_sp": 3}, "heads-sp"),
        ("dense", {"ulysses_sp": 3}, "world-grid"),
        ("dense", {"fsdp_size": 3}, "fsdp-size"),
        ("dense", {"ep": 2}, "fsdp-parallel"),
    ],
)
def test_broken_layouts_name_the_rule(model, changes, rule):
    shape = QWEN3_30B_A3B if model == "moe" else QWEN3_1P7B
    lay = dataclasses.replace(_base(model), **changes)
    violations = check_layout(shape, lay) + memory_violations(lay, estimate_memory(shape, lay, H100_80GB_GIB))
    assert rule in {v.rule for v in violations}, [str(v) for v in violations]


def test_every_violation_is_listed_not_just_the_first():
    lay = dataclasses.replace(_base("moe"), tp=3, ep=3, rollout_tp=3, ppo_mini_batch_size=48)
    rules = {v.rule for v in check_layout(QWEN3_30B_A3B, lay)}
    assert {"world-grid", "experts-ep", "heads-tp", "rollout-tp-node", "batch-mini"} <= rules


def test_cpu_optimizer_without_the_precision_aware_optimizer_is_refused():
    # megatron-LM's argument check: optimizer CPU offload must go with --use-precision-aware-optimizer.
    key = "actor_rollout_ref.actor.optim.use_precision_aware_optimizer"
    assert "optimizer-cpu-offload" in _rules("qwen3_30b_a3b_h100_1x8", f"{key}=false")
    assert "optimizer-cpu-offload" not in _rules("qwen3_30b_a3b_h100_1x8")
    # verl copies override_optimizer_config over its own keys, so the override decides
    override = "actor_rollout_ref.actor.optim.override_optimizer_config.use_precision_aware_optimizer"
    assert "optimizer-cpu-offload" in _rules("qwen3_30b_a3b_h100_1x8", f"+{override}=false")


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.nnodes=0"],
        ["trainer.n_gpus_per_node=0"],
        ["trainer.nnodes=-2"],
        [f"{MG}.tensor_model_parallel_size=0"],
        ["actor_rollout_ref.rollout.tensor_model_parallel_size=0"],
    ],
)
def test_counts_below_one_are_refused_by_the_world_size_rule(overrides):
    preset = "qwen3_30b_a3b_h100_2x8"
    _, mem, violations, _ = plan(preset, overrides)
    assert {v.rule for v in violations} == {"world-size"}, [str(v) for v in violations]
    assert mem is None  # nothing to estimate for an empty or degenerate grid
    assert overrides[0].split("=")[0] in " ".join(str(v) for v in violations)


def test_fsdp_counts_below_one_are_refused():
    sp = "ulysses_sequence_parallel_size=0"
    _, mem, violations, _ = plan(
        "qwen3_1p7b_h100_1x8", [f"actor_rollout_ref.actor.{sp}", f"actor_rollout_ref.actor.fsdp_config.{sp}"]
    )
    assert {v.rule for v in violations} == {"world-size"} and mem is None


PAPER_H200 = (
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=18432",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=18432",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
)


def test_the_papers_h200_settings_cannot_start_on_verl_0_9_1():
    # vLLM checks free memory >= gpu_memory_utilization x total at start; verl 0.9.1 starts it after building the
    # trainer, which keeps weights, grad buffer and fp32 main params on the GPU without offload.
    _, mem, violations, _ = plan("qwen3_30b_a3b_h200_1x8", list(PAPER_H200))
    assert {v.rule for v in violations} == {"rollout-startup", "memory-rollout"}, [str(v) for v in violations]
    assert mem.rollout_startup_needed_gib == pytest.approx(0.85 * 140.4)
    assert mem.rollout_startup_free_gib < mem.rollout_startup_needed_gib
    # the same settings start once the trainer leaves the GPU before vLLM starts
    offloaded = [*PAPER_H200, f"{MG}.param_offload=true", f"{MG}.optimizer_offload=true"]
    assert "rollout-startup" not in _rules("qwen3_30b_a3b_h200_1x8", *offloaded)


def test_pp2_with_vpp_is_refused_only_when_overlap_p2p_comm_is_turned_off():
    """verl and mbridge set overlap_p2p_comm=true under VPP, which keeps megatron-core 0.16.1 from crossing the
    activation and gradient shapes at PP = 2 (docs/routing-replay.md); only an override to false is refused."""
    mg = "actor_rollout_ref.actor.megatron"
    pp2_vpp2 = (f"{mg}.pipeline_model_parallel_size=2", f"{mg}.virtual_pipeline_model_parallel_size=2")
    key = f"+{mg}.override_transformer_config.overlap_p2p_comm"
    assert "pp2-vpp-p2p" not in _rules("qwen3_30b_a3b_h100_2x8", *pp2_vpp2)
    assert "pp2-vpp-p2p" not in _rules("qwen3_30b_a3b_h100_2x8", *pp2_vpp2, f"{key}=true")
    assert "pp2-vpp-p2p" in _rules("qwen3_30b_a3b_h100_2x8", *pp2_vpp2, f"{key}=false")
    assert "pp2-vpp-p2p" not in _rules("qwen3_30b_a3b_h100_2x8", f"{key}=false")  # no virtual pipeline
