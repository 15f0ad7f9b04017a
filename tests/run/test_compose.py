"""respo_verl.run.compose: the one compose function. Same job as Hydra's own `pkg://` composition of both entry points,
no verl import, one-line errors, Hydra's global state cleared."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from respo_verl.run.compose import CPU_COMPOSE_OVERRIDES, ComposeError, compose_job, package_dir

CASES = [
    ("respo", ["algorithm=respo"]),
    ("respo", ["algorithm=vespo", "model_engine=megatron", "routing=r2"]),
    ("respo", ["algorithm=respo", "+cluster=qwen3_30b_a3b_h100_2x8", "+task=dapo_math_overlong"]),
    ("verl", ["+algorithm=gspo", "+cluster=qwen3_1p7b_h100_1x8", "+task=dapo_math"]),
]


def _compose_as_entry_point(entry: str, overrides: list[str]):
    """Hydra's compose API with `pkg://` config modules, as `@hydra.main` of the two entry points resolves them."""
    from hydra import compose, initialize_config_module

    module, name = {"respo": ("respo_verl.configs", "respo_trainer"), "verl": ("verl.trainer.config", "ppo_trainer")}[
        entry
    ]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=module, version_base=None):
            return compose(config_name=name, overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.parametrize("entry, overrides", CASES, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_same_job_as_the_entry_points_compose(entry, overrides):
    ours = OmegaConf.to_container(compose_job(entry, overrides), resolve=True)
    theirs = OmegaConf.to_container(_compose_as_entry_point(entry, overrides), resolve=True)
    assert ours == theirs


def test_composing_does_not_import_verl_or_torch():
    code = (
        "import sys\n"
        "from respo_verl.run.compose import compose_job\n"
        "compose_job('respo', ['algorithm=respo', '+cluster=qwen3_30b_a3b_h200_1x8'])\n"
        "compose_job('verl', ['+algorithm=vespo', '+cluster=qwen3_1p7b_h100_1x8'])\n"
        "print(sorted(m for m in ('verl', 'torch', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "entry, overrides, fragment",
    [
        ("respo", ["trainer.no_such_key=1"], "no_such_key"),
        ("respo", ["algorithm=no_such_algorithm"], "no_such_algorithm"),
        ("respo", ["trainer.nnodes"], "trainer.nnodes"),
        ("verl", ["+cluster=no_such_cluster"], "no_such_cluster"),
        ("nope", [], "entry must be one of"),
    ],
)
def test_errors_are_one_line_value_errors(entry, overrides, fragment):
    with pytest.raises(ComposeError) as info:
        compose_job(entry, overrides)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert fragment in message and "\n" not in message
    assert info.value.__suppress_context__ or info.value.__cause__ is None
    assert not GlobalHydra.instance().is_initialized()


def test_global_hydra_is_cleared_after_a_compose():
    compose_job("respo", ["algorithm=grpo"])
    assert not GlobalHydra.instance().is_initialized()


def test_cpu_overrides_let_verl_build_the_actor_dataclasses(model_engine):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPActorConfig, McoreActorConfig, RolloutConfig

    cfg = compose_job("respo", ["algorithm=respo", f"model_engine={model_engine}", *CPU_COMPOSE_OVERRIDES])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor) is (McoreActorConfig if model_engine == "megatron" else FSDPActorConfig)
    assert isinstance(omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout), RolloutConfig)


def test_package_dir_finds_verl_configs_without_importing():
    folder = package_dir("verl.trainer.config")
    assert (folder / "ppo_trainer.yaml").is_file()
    with pytest.raises(ComposeError, match="no_such_package"):
        package_dir("no_such_package.config")
