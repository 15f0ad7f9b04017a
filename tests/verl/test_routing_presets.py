"""The `routing` presets (off, r2, r3) compose with both entry points, set every key verl 0.9.1 reads for routing
replay on the Megatron engine, pass verl's validate_config and dataclass conversion, and R2 refuses bypass mode."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CPU_COMPOSE_OVERRIDES, compose
from omegaconf import OmegaConf
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.config import McoreActorConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "configs"
EXPECTED = {
    # preset: (router_replay.mode of actor and ref, rollout.enable_rollout_routing_replay, our diagnostics)
    "off": ("disabled", False, False),
    "r2": ("R2", False, True),
    "r3": ("R3", True, True),
}


def _compose(entry: str, routing: str, extra: tuple[str, ...] = ()):
    plus = "" if entry == "respo" else "+"  # groups of our primary config, appended to verl's
    choices = (f"{plus}algorithm=respo", f"{plus}routing={routing}")
    return compose([*choices, "model_engine=megatron", *CPU_COMPOSE_OVERRIDES, *extra], entry=entry)


def _validate(cfg) -> None:
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def test_every_preset_is_covered():
    assert sorted(p.stem for p in (CONF_DIR / "routing").glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("entry", ["respo", "verl"])
@pytest.mark.parametrize("routing", sorted(EXPECTED))
def test_preset_sets_verls_keys_and_validates(entry, routing):
    cfg = _compose(entry, routing)
    mode, rollout_flag, diagnostics = EXPECTED[routing]
    arr = cfg.actor_rollout_ref
    assert arr.actor.megatron.router_replay.mode == mode
    assert arr.ref.megatron.router_replay.mode == mode
    assert arr.rollout.enable_rollout_routing_replay is rollout_flag
    env = OmegaConf.select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars", default={}) or {}
    assert (env.get("VERL_ENGINE_VENDOR") == "respo_route_drift") is diagnostics

    _validate(cfg)
    actor = omega_conf_to_dataclass(arr.actor)
    assert type(actor) is McoreActorConfig and actor.megatron.router_replay.mode == mode
    assert actor.policy_loss.loss_mode == "respo"  # the algorithm preset survives


def test_our_entry_point_defaults_to_no_replay():
    cfg = compose(["model_engine=megatron", *CPU_COMPOSE_OVERRIDES])
    assert cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "disabled"
    assert "respo_verl" not in cfg.actor_rollout_ref


@pytest.mark.parametrize("routing", ["r2", "r3"])
def test_presets_compose_the_same_job_through_both_entry_points(routing):
    ours = OmegaConf.to_container(_compose("respo", routing), resolve=True)
    theirs = OmegaConf.to_container(_compose("verl", routing), resolve=True)
    assert ours == theirs


def test_r2_refuses_bypass_mode():
    cfg = _compose("respo", "r2", ("algorithm.rollout_correction.bypass_mode=true",))
    with pytest.raises(ValueError, match=r"router_replay.mode='R2' requires .*bypass_mode=False"):
        _validate(cfg)
    # R3 takes its routes from the rollout, so bypass mode (rollout log-probs as π_old) is allowed.
    _validate(_compose("respo", "r3", ("algorithm.rollout_correction.bypass_mode=true",)))


@pytest.mark.parametrize("routing", ["r2", "r3"])
def test_replay_presets_fail_loudly_on_the_fsdp_engine(routing):
    """verl 0.9.1 replays on the Megatron engine only; with model_engine=dp the megatron keys do not convert."""
    cfg = compose([f"routing={routing}", "model_engine=dp", *CPU_COMPOSE_OVERRIDES])
    with pytest.raises(Exception, match="unexpected keyword argument 'megatron'"):
        _validate(cfg)


def test_off_composes_with_the_fsdp_engine():
    cfg = compose(["routing=off", "model_engine=dp", *CPU_COMPOSE_OVERRIDES])
    _validate(cfg)
    omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_done_when_command_composes(tmp_path):
    from support.entry import run_entry

    out = run_entry(
        ["algorithm=respo", "routing=r3", "model_engine=megatron", "actor_rollout_ref.rollout.name=vllm",
         "--cfg", "job"],
        tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    job = OmegaConf.create(out.stdout)
    assert job.actor_rollout_ref.actor.megatron.router_replay.mode == "R3"
    assert job.actor_rollout_ref.rollout.enable_rollout_routing_replay is True
    assert job.ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR == "respo_route_drift"
