"""Planner metadata of the shipped cluster presets (``configs/cluster/<name>.yaml``), and composing them.

verl never sees this table: which model a preset is for and how much memory its GPUs have are planner facts, kept
here so that the job config carries only keys verl reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from omegaconf import DictConfig

from respo_verl.entry_points import CONFIG_PACKAGE
from respo_verl.run.compose import ComposeError, compose_job

# Usable memory per GPU as the driver reports it (nvidia-smi total), in GiB.
H100_80GB_GIB = 79.6  # 81559 MiB
H200_141GB_GIB = 140.4  # 143771 MiB

GPU_MEMORY_GIB = {"h100": H100_80GB_GIB, "h200": H200_141GB_GIB}
# Memory of the node the TaskRunner runs on: DGX H100 and DGX H200 ship 2 TB; --host-memory-gib for others.
HOST_MEMORY_GIB = {"h100": 2e12 / 2**30, "h200": 2e12 / 2**30}


@dataclass(frozen=True)
class PresetInfo:
    model: str  # key of respo_verl.layout.models.SHIPPED_MODELS
    gpu: str  # key of GPU_MEMORY_GIB
    # Rule ids the planner reports for a preset kept as a record although it does not start (empty: it must fit).
    refused_by: tuple[str, ...] = ()


PRESETS: dict[str, PresetInfo] = {
    "qwen3_30b_a3b_h100_1x8": PresetInfo("qwen3_30b_a3b", "h100"),
    "qwen3_30b_a3b_h100_2x8": PresetInfo("qwen3_30b_a3b", "h100"),
    "qwen3_30b_a3b_h100_4x8": PresetInfo("qwen3_30b_a3b", "h100"),
    "qwen3_30b_a3b_h100_8x8": PresetInfo("qwen3_30b_a3b", "h100"),
    "qwen3_30b_a3b_h200_1x8": PresetInfo("qwen3_30b_a3b", "h200"),
    # The paper's exact H200 settings: vLLM cannot start next to the resident trainer on verl 0.9.1.
    "qwen3_30b_a3b_h200_1x8_paper": PresetInfo(
        "qwen3_30b_a3b", "h200", refused_by=("memory-rollout", "rollout-startup")
    ),
    "qwen3_1p7b_h100_1x8": PresetInfo("qwen3_1p7b", "h100"),
    "qwen3_1p7b_h100_2x8": PresetInfo("qwen3_1p7b", "h100"),
}

CLUSTER_GROUP = "cluster"


class PresetError(ValueError):
    """Unknown preset, or a preset/override that Hydra cannot compose."""


def shipped_presets() -> list[str]:
    """Names of the YAML files in the ``cluster`` config group (package data)."""
    folder = resources.files(CONFIG_PACKAGE) / CLUSTER_GROUP
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def compose_preset(preset: str, overrides: list[str] | tuple[str, ...] = (), algorithm: str = "respo") -> DictConfig:
    """Compose ``python -m respo_verl.main_ppo algorithm=<algorithm> +cluster=<preset> <overrides>``.

    Raises:
        PresetError: unknown preset, or an override Hydra rejects (the message is Hydra's, without its traceback).
    """
    known = shipped_presets()
    if preset not in known:
        raise PresetError(f"unknown preset {preset!r}; shipped presets: {', '.join(known)}")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise PresetError(f"override(s) {bad} are not of the form key=value (Hydra syntax, e.g. trainer.nnodes=2)")
    try:
        return compose_job("respo", [f"algorithm={algorithm}", f"+{CLUSTER_GROUP}={preset}", *overrides])
    except ComposeError as err:
        raise PresetError(f"cannot compose preset {preset!r} with overrides {list(overrides)}: {err}") from None
