"""Every shipped Hydra config composes with both entry points, passes verl's validate_config, and converts to
verl's dataclasses; YAML defaults equal the dataclass defaults; invalid hyperparameters fail naming the key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_COMPOSE_OVERRIDES, actor_config, compose
from omegaconf import OmegaConf
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.config import FSDPActorConfig, McoreActorConfig

from respo_verl.core.config import CONFIG_BLOCKS, ReSPOConfig, VESPOConfig
from respo_verl.core.losses import KERNELS
from respo_verl.entry_points import PLUGIN_MODULE
from respo_verl.verl.config import ReSPOPolicyLossConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "configs"
ALGORITHMS = sorted(p.stem for p in (CONF_DIR / "algorithm").glob("*.yaml"))
EXPECTED = {
    # algorithm: (loss_mode, loss_agg_mode, adv_estimator, clip_ratio_low, clip_ratio_high)
    "respo": ("respo", "token-mean", "respo", None, None),
    "vespo": ("vespo", "token-mean", "respo", None, None),
    "grpo": ("vanilla", "token-mean", "grpo", 0.2, 0.2),
    "gspo": ("gspo", "seq-mean-token-mean", "grpo", 3e-4, 4e-4),
    # The branch ablation (docs/method.md, "Branch ablation").
    "respo_pos": ("respo_pos", "token-mean", "respo", None, None),
    "respo_neg": ("respo_neg", "token-mean", "respo", None, None),
    "phi_one": ("phi_one", "token-mean", "respo", None, None),
    "grpo_noclip": ("vanilla", "token-mean", "grpo", 1.0, 1.0e9),
}
KERNEL_LOSSES = tuple(KERNELS)
ACTOR_CLASS = {"dp": FSDPActorConfig, "megatron": McoreActorConfig}


def test_every_preset_is_covered():
    assert ALGORITHMS == sorted(EXPECTED)


def _compose(entry: str, algorithm: str, model_engine: str, extra: tuple[str, ...] = ()):
    choice = f"algorithm={algorithm}" if entry == "respo" else f"+algorithm={algorithm}"
    return compose([choice, f"model_engine={model_engine}", *CPU_COMPOSE_OVERRIDES, *extra], entry=entry)


@pytest.mark.parametrize("entry", ["respo", "verl"])
@pytest.mark.parametrize("algorithm", sorted(EXPECTED))
def test_preset_composes_validates_and_converts(entry, algorithm, model_engine):
    cfg = _compose(entry, algorithm, model_engine)
    loss_mode, agg, estimator, clip_low, clip_high = EXPECTED[algorithm]
    actor = cfg.actor_rollout_ref.actor
    assert actor.policy_loss.loss_mode == loss_mode
    assert actor.loss_agg_mode == agg
    assert cfg.algorithm.adv_estimator == estimator
    assert actor.use_kl_loss is False and cfg.algorithm.use_kl_in_reward is False
    assert actor.entropy_coeff == 0 and actor.ppo_epochs == 1
    if clip_low is not None:
        assert (actor.clip_ratio_low, actor.clip_ratio_high) == (clip_low, clip_high)
    # verl's own rollout-correction group survives our algorithm group.
    assert "rollout_correction" in cfg.algorithm

    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor_dc = omega_conf_to_dataclass(actor)
    assert type(actor_dc) is ACTOR_CLASS[model_engine]
    assert isinstance(omega_conf_to_dataclass(cfg.algorithm), AlgoConfig)
    if algorithm in KERNEL_LOSSES:
        assert type(actor_dc.policy_loss) is ReSPOPolicyLossConfig
        assert actor_dc.policy_loss.respo == ReSPOConfig() and actor_dc.policy_loss.vespo == VESPOConfig()
        env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
        assert env.VERL_USE_EXTERNAL_MODULES == PLUGIN_MODULE


def test_entry_points_compose_the_same_job():
    for algorithm in EXPECTED:
        ours = OmegaConf.to_container(_compose("respo", algorithm, "megatron"), resolve=True)
        theirs = OmegaConf.to_container(_compose("verl", algorithm, "megatron"), resolve=True)
        assert ours == theirs, algorithm


def test_our_entry_point_defaults_to_respo():
    cfg = compose(CPU_COMPOSE_OVERRIDES)
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "respo"


@pytest.mark.parametrize(
    "preset, block, cls",
    [(name, block, CONFIG_BLOCKS[block]) for name, spec in KERNELS.items() for block in spec.blocks],
)
def test_yaml_defaults_equal_dataclass_defaults(preset, block, cls):
    node = OmegaConf.load(CONF_DIR / "algorithm" / f"{preset}.yaml").actor_rollout_ref.actor.policy_loss
    yaml_values = {k: v for k, v in OmegaConf.to_container(node[block]).items() if k != "_target_"}
    yaml_values.pop("rollout_is_level")  # an interpolation, checked below
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name != "rollout_is_level"}
    assert yaml_values == defaults
    assert node[block]["_target_"] == f"{cls.__module__}.{cls.__name__}"


def test_the_verl_config_class_has_a_field_per_kernel_block():
    """Adding a block to respo_verl.core.config.CONFIG_BLOCKS needs its field here (the presets set it by name)."""
    from respo_verl.verl.config import ReSPOPolicyLossConfig

    fields = {f.name: f for f in dataclasses.fields(ReSPOPolicyLossConfig)}
    for block, cls in CONFIG_BLOCKS.items():
        assert block in fields and fields[block].type in (cls, cls.__name__), block


@pytest.mark.parametrize("algorithm", ["respo", "vespo"])
def test_kernel_hyperparameters_are_settable_from_the_command_line(algorithm, model_engine):
    keys = {
        "respo": {"alpha_pos": 3.0, "beta_pos": 0.25, "lambda_pos": 1.5, "alpha_neg": 1.5, "beta_neg": 0.75,
                  "lambda_neg": 0.5, "log_w_clip": 15.0},
        "vespo": {"k_pos": 1.0, "lambda_pos": 2.5, "k_neg": 2.0, "lambda_neg": 1.0, "log_w_clip": 10.0},
    }[algorithm]  # fmt: skip
    prefix = f"actor_rollout_ref.actor.policy_loss.{algorithm}"
    actor = actor_config(model_engine, algorithm, tuple(f"{prefix}.{k}={v}" for k, v in keys.items()))
    kernel = getattr(actor.policy_loss, algorithm)
    assert {k: getattr(kernel, k) for k in keys} == keys


def test_rollout_is_level_follows_verls_rollout_correction():
    assert actor_config("dp", "respo").policy_loss.respo.rollout_is_level == "token"
    seq = actor_config("dp", "respo", ("algorithm.rollout_correction.rollout_is=sequence",))
    assert seq.policy_loss.respo.rollout_is_level == "sequence"
    tok = actor_config("megatron", "vespo", ("algorithm.rollout_correction.rollout_is=token",))
    assert tok.policy_loss.vespo.rollout_is_level == "token"


@pytest.mark.parametrize(
    "override, message",
    [
        ("respo.alpha_pos=0.5", "ReSPOConfig.alpha_pos must be >= 1"),
        ("respo.beta_neg=0", r"ReSPOConfig.beta_neg must be in \(0, 1\]"),
        ("respo.lambda_pos=-1", "ReSPOConfig.lambda_pos must be >= 0"),
        ("respo.log_w_clip=0", "ReSPOConfig.log_w_clip must be > 0"),
    ],
)
def test_invalid_hyperparameters_fail_in_validate_config(override, message):
    cfg = _compose("verl", "respo", "megatron", (f"actor_rollout_ref.actor.policy_loss.{override}",))
    with pytest.raises(Exception) as info:
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert info.match(message)


def test_unknown_loss_mode_fails_in_validate_config():
    cfg = _compose("verl", "respo", "dp", ("actor_rollout_ref.actor.policy_loss.loss_mode=respoo",))
    with pytest.raises(Exception) as info:
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert info.match("'respoo' is not registered in verl")
    assert info.match("install respo-verl in the Python environment of every node")


@pytest.mark.slow
def test_command_lines_print_a_composed_job():
    """Both entry points' real command lines; the two processes run side by side (each spends its time importing)."""
    argvs = {
        "ours": ["-m", "respo_verl.main_ppo", "algorithm=respo", "model_engine=megatron"],
        "verl": ["-m", "verl.trainer.main_ppo", "+algorithm=respo", "model_engine=megatron"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, *argv, "actor_rollout_ref.rollout.name=vllm", "--cfg", "job"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in argvs.items()
    }
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: {stderr[-3000:]}"
        job = OmegaConf.create(stdout)
        assert job.actor_rollout_ref.actor.policy_loss.loss_mode == "respo", name
        assert job.actor_rollout_ref.actor.strategy == "megatron", name
        assert "      loss_mode: respo\n" in stdout, name
