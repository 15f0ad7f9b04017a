"""Every cluster preset composes with both entry points, passes verl's validate_config and dataclass conversion,
stays out of the algorithm's keys, and is accepted by the planner."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from conftest import compose
from omegaconf import OmegaConf
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, McoreActorConfig, McoreEngineConfig, RolloutConfig

from respo_verl.planner.cli import plan
from respo_verl.planner.presets import PRESETS, shipped_presets

CONF = Path(__file__).resolve().parents[2] / "respo_verl" / "verl" / "conf"
PRESET_NAMES = sorted(PRESETS)
# Keys owned by algorithm/*.yaml: a cluster preset must not set them.
ALGORITHM_OWNED = (
    "algorithm",
    "policy_loss",
    "loss_agg_mode",
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "use_kl_loss",
    "entropy_coeff",
    "ppo_epochs",
    "kl_loss_coef",
)


@cache
def _job(entry: str, preset: str, task: str = "dapo_math_overlong"):
    choice = "algorithm=respo" if entry == "respo" else "+algorithm=respo"
    return compose([choice, f"+cluster={preset}", f"+task={task}"], entry=entry)


def test_every_shipped_preset_has_planner_metadata():
    assert shipped_presets() == PRESET_NAMES


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_preset_composes_and_validates_with_both_entry_points(preset):
    jobs = {entry: _job(entry, preset) for entry in ("respo", "verl")}
    for cfg in jobs.values():
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        expected = McoreActorConfig if "30b" in preset else FSDPActorConfig
        assert type(actor) is expected
        # verl's worker renames the ref's log_prob_* keys before building the ref actor; its engine config is
        # converted as it stands.
        ref = cfg.actor_rollout_ref.ref
        ref_engine = omega_conf_to_dataclass(ref.megatron if "30b" in preset else ref.fsdp_config)
        assert type(ref_engine) is (McoreEngineConfig if "30b" in preset else FSDPEngineConfig)
        assert isinstance(omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout), RolloutConfig)
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "respo"  # the algorithm survives the preset
    assert OmegaConf.to_container(jobs["respo"], resolve=True) == OmegaConf.to_container(jobs["verl"], resolve=True)


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_planner_accepts_every_preset(preset):
    _, mem, violations, _ = plan(preset)
    assert violations == [], [str(v) for v in violations]
    assert 0 < mem.peak_gib <= mem.gpu_gib


def _keys(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{prefix}{k}"
            yield from _keys(v, f"{prefix}{k}.")


@pytest.mark.parametrize(
    "path",
    sorted((CONF / "cluster").glob("*.yaml"))
    + sorted((CONF / "respo_verl").glob("qwen3*.yaml"))
    + [CONF / "respo_verl" / "protocol.yaml"],
    ids=lambda p: p.stem,
)
def test_presets_leave_algorithm_keys_alone(path):
    keys = list(_keys(OmegaConf.to_container(OmegaConf.load(path))))
    owned = [k for k in keys if k.split(".")[-1] in ALGORITHM_OWNED or k.startswith("algorithm")]
    assert owned == [], f"{path.name} sets algorithm-owned keys {owned}"


def test_paper_layouts():
    h200 = _job("respo", "qwen3_30b_a3b_h200_1x8")
    mg = h200.actor_rollout_ref.actor.megatron
    assert (mg.tensor_model_parallel_size, mg.expert_model_parallel_size, mg.expert_tensor_parallel_size) == (2, 8, 1)
    assert mg.pipeline_model_parallel_size == 1 and not mg.param_offload and not mg.optimizer_offload
    assert mg.override_transformer_config.moe_router_dtype == "fp32"
    assert mg.override_transformer_config.moe_token_dispatcher_type == "flex"
    assert mg.override_transformer_config.recompute_granularity == "full"
    assert h200.actor_rollout_ref.rollout.tensor_model_parallel_size == 4
    assert h200.data.max_response_length == 8192
    # ref follows the actor's grid
    assert h200.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2
    assert h200.actor_rollout_ref.ref.megatron.expert_model_parallel_size == 8
    small = _job("respo", "qwen3_1p7b_h100_1x8", "dapo_math")
    assert small.actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size == 2
    assert small.actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size == 2
    assert small.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert small.data.max_response_length == 15360


def test_task_presets_set_the_dapo_reward():
    cfg = _job("verl", "qwen3_30b_a3b_h100_2x8")
    assert cfg.reward.reward_manager.name == "dapo"
    kwargs = OmegaConf.to_container(cfg.reward.reward_kwargs, resolve=True)
    assert kwargs == {
        "max_resp_len": 8192,
        "overlong_buffer_cfg": {"enable": True, "len": 4096, "penalty_factor": 1.0, "log": True},
    }
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    assert (val.temperature, val.top_p, val.n, val.do_sample) == (1.0, 0.7, 16, True)
    plain = _job("respo", "qwen3_1p7b_h100_1x8", "dapo_math")
    assert plain.reward.reward_kwargs.overlong_buffer_cfg.enable is False
