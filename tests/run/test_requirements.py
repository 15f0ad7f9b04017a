"""What each composed job needs installed (respo_verl.run.requirements.job_requirements), from the shipped presets
and the CPU presets, composed as the entry point composes them."""

from __future__ import annotations

from functools import cache

import pytest
from conftest import compose

from respo_verl.run.requirements import Requirement, install_line, job_requirements
from respo_verl.tools.plan.presets import PRESETS

MG = "actor_rollout_ref.actor.megatron"
TF = f"{MG}.override_transformer_config"
ALLTOALL = f"{TF}.moe_token_dispatcher_type=alltoall"
MEGATRON_PRESETS = sorted(p for p in PRESETS if "30b" in p)
FSDP_PRESETS = sorted(p for p in PRESETS if "1p7b" in p)


@cache
def _requirements(*overrides: str) -> dict[str, Requirement]:
    reqs = job_requirements(compose(["algorithm=respo", *overrides]))
    assert len({r.module for r in reqs}) == len(reqs), reqs  # one entry per package
    return {r.module: r for r in reqs}


def _preset(preset: str, *overrides: str) -> dict[str, Requirement]:
    return _requirements(f"+cluster={preset}", "+task=dapo_math_overlong", *overrides)


@pytest.mark.parametrize("preset", MEGATRON_PRESETS)
def test_megatron_presets_need_the_papers_stack(preset):
    reqs = _preset(preset)
    assert set(reqs) == {"torch", "vllm", "megatron.core", "transformer_engine", "mbridge", "deep_ep", "flash_attn"}
    assert reqs["torch"].gpus == 8 and "trainer.n_gpus_per_node=8" in reqs["torch"].why_key
    assert reqs["vllm"].why_key == "actor_rollout_ref.rollout.name=vllm"
    assert reqs["mbridge"].why_key == f"{MG}.vanilla_mbridge=true"
    assert reqs["deep_ep"].why_key.startswith(f"{TF}.moe_token_dispatcher_type=flex")
    assert "moe_flex_dispatcher_backend=deepep" in reqs["deep_ep"].why_key
    assert reqs["flash_attn"].why_key.startswith(f"{TF}.attention_backend=flash")
    assert reqs["flash_attn"].alternatives == ("flash_attn_3",)  # Transformer Engine takes flash-attn 2 or 3
    assert "apex" not in reqs  # megatron-core falls back from TE to Apex to torch; TE is there


@pytest.mark.parametrize("preset", MEGATRON_PRESETS)
def test_the_alltoall_override_drops_deepep_only(preset):
    with_deepep, without = _preset(preset), _preset(preset, ALLTOALL)
    assert "deep_ep" not in without
    assert set(with_deepep) - set(without) == {"deep_ep"}


def test_megatron_bridge_instead_of_mbridge_with_vanilla_mbridge_false():
    reqs = _preset(MEGATRON_PRESETS[0], f"{MG}.vanilla_mbridge=false")
    assert "mbridge" not in reqs
    assert reqs["megatron.bridge"].why_key == f"{MG}.vanilla_mbridge=false"
    assert reqs["megatron.bridge"].package == "Megatron-Bridge"


def test_verls_megatron_default_asks_for_flash_attention():
    """verl's engine/megatron.yaml sets attention_backend=flash: Transformer Engine's flash backend needs flash-attn."""
    reqs = _requirements("model_engine=megatron")
    assert {"megatron.core", "megatron.bridge", "transformer_engine", "flash_attn", "torch"} <= set(reqs)
    assert "deep_ep" not in reqs  # verl's default dispatcher is not flex
    unset = _requirements("model_engine=megatron", f"~{TF}.attention_backend")
    assert "flash_attn" in unset  # verl's Megatron-Bridge path asks for flash itself
    mbridge = _requirements("model_engine=megatron", f"{MG}.vanilla_mbridge=true", f"~{TF}.attention_backend")
    assert "flash_attn" not in mbridge and "mbridge" in mbridge  # megatron-core's default there: auto


def test_another_attention_backend_drops_flash_attn():
    reqs = _preset(MEGATRON_PRESETS[0], f"{TF}.attention_backend=fused")
    assert "flash_attn" not in reqs and "transformer_engine" in reqs


@pytest.mark.parametrize("preset", FSDP_PRESETS)
def test_fsdp_presets_need_vllm_flash_attn_and_gpus(preset):
    reqs = _preset(preset)
    assert set(reqs) == {"torch", "vllm", "flash_attn"}
    assert "attn_implementation=flash_attention_2 (verl's default)" in reqs["flash_attn"].why_key
    sdpa = _preset(preset, "+actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    assert set(sdpa) == {"torch", "vllm"}


def test_sglang_rollout():
    reqs = _preset(FSDP_PRESETS[0], "actor_rollout_ref.rollout.name=sglang")
    assert "vllm" not in reqs and reqs["sglang"].why_key == "actor_rollout_ref.rollout.name=sglang"


def test_gpu_count_follows_the_job():
    assert _preset(FSDP_PRESETS[0], "trainer.n_gpus_per_node=4")["torch"].gpus == 4


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (("+device=cpu",), set()),  # FSDP2 on gloo with our hf_cpu rollout: none of the GPU stack
        (("+device=cpu_megatron", "model_engine=megatron"), {"megatron.core", "mbridge"}),
    ],
    ids=["cpu", "cpu_megatron"],
)
def test_the_cpu_presets_need_none_of_the_gpu_stack(overrides, expected):
    assert set(_requirements(*overrides)) == expected


def test_the_install_line_lists_every_package():
    line = install_line(list(_preset(MEGATRON_PRESETS[0]).values()))
    assert line.startswith("needs installed: 8 CUDA GPU(s) per node, vLLM (import vllm)")
    for name in ("import deep_ep", "import mbridge", "import transformer_engine", "import flash_attn or import"):
        assert name in line
    assert "\n" not in line
    assert install_line([]) == "needs installed: nothing beyond respo-verl and verl"
