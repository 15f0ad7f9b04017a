"""The CPU presets as one family: ``+device=cpu`` (FSDP) and ``+device=cpu_megatron`` (Megatron) compose the shared
``configs/respo_verl/cpu.yaml`` and state only their engine's settings and their kit; their jobs are named in the
package's one run-name scheme (respo_verl/run/resolvers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import compose
from omegaconf import OmegaConf

from respo_verl.run.resolvers import run_name

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHARED = CONFIGS / "respo_verl" / "cpu.yaml"
PRESETS = {"cpu": CONFIGS / "device" / "cpu.yaml", "cpu_megatron": CONFIGS / "device" / "cpu_megatron.yaml"}
FSDP_JOB = ["algorithm=respo", "+device=cpu"]
MEGATRON_JOB = ["algorithm=respo", "routing=r2", "model_engine=megatron", "+device=cpu_megatron"]
GRPO_N8_SEED3 = ["algorithm=grpo", "+device=cpu", "data.train_batch_size=16", "actor_rollout_ref.rollout.seed=3"]


def _leaves(node, prefix: str = "") -> dict[str, object]:
    """Every leaf of a raw (unresolved) config file, by dotted key, without its defaults list."""
    out = {}
    for key, value in node.items():
        if not prefix and key == "defaults":
            continue
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_leaves(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def _raw(path: Path) -> dict[str, object]:
    return _leaves(OmegaConf.to_container(OmegaConf.load(path), resolve=False))


def test_each_preset_composes_the_shared_file_first_and_repeats_none_of_it():
    shared = _raw(SHARED)
    for name, path in PRESETS.items():
        assert OmegaConf.load(path).defaults == ["/respo_verl/cpu@_global_", "_self_"], name
        repeated = {key: value for key, value in _raw(path).items() if shared.get(key, object()) == value}
        assert not repeated, f"device/{name}.yaml repeats configs/respo_verl/cpu.yaml: {repeated}"


def test_the_presets_share_no_setting_outside_the_shared_file():
    fsdp, megatron = _raw(PRESETS["cpu"]), _raw(PRESETS["cpu_megatron"])
    both = {key: value for key, value in fsdp.items() if key in megatron and megatron[key] == value}
    assert not both, f"set alike by both presets, so the shared file's: {both}"


def test_each_job_holds_its_engines_settings_only_and_the_shared_cpu_bounds():
    """verl's Megatron actor config refuses FSDP keys (and the FSDP one Megatron keys): the shared file holds none."""
    shared_guard = OmegaConf.to_container(OmegaConf.load(SHARED).run_guard)
    for job, engine, other in ((FSDP_JOB, "fsdp_config", "megatron"), (MEGATRON_JOB, "megatron", "fsdp_config")):
        cfg = compose(job)
        for role in ("actor", "ref"):
            node = cfg.actor_rollout_ref[role]
            assert engine in node and other not in node, (job, role)
        assert {key: cfg.run_guard[key] for key in shared_guard} == shared_guard
        assert cfg.trainer.project_name == "respo_verl_cpu" and cfg.trainer.total_training_steps == 8


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        (FSDP_JOB, run_name("dense", "respo", 4, 42)),
        (GRPO_N8_SEED3, run_name("dense", "grpo", 8, 3)),
        (["algorithm=respo", "+device=cpu", "+task=cpu_chain"], run_name("chain", "respo", 4, 42)),
        (MEGATRON_JOB, run_name("moe", "respo", 4, 42, "r2")),
        (["algorithm=vespo", "model_engine=megatron", "+device=cpu_megatron"], run_name("moe", "vespo", 4, 42)),
    ],
)
def test_a_cpu_job_is_named_in_the_one_run_name_scheme_after_its_kit(job, expected):
    trainer = compose(job).trainer
    assert (trainer.experiment_name, trainer.default_local_dir) == (expected, f"checkpoints/respo_verl_cpu/{expected}")
