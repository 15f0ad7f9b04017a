"""The ``device=cpu`` preset seen from the driver: is a job a CPU job, can the CPU path run it, and its kit.

Imports neither verl nor torch (the checks run before anything heavy). Importing :mod:`respo_verl.verl.cpu` is what
switches a process to verl on CPU; :func:`prepare_driver` does that for the driver of ``respo_verl.main_ppo``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PRESET = "+device=cpu"
ROLLOUT_NAME = "hf_cpu"  # respo_verl.verl.patches.verl_0_9_1_cpu_rollout.ROLLOUT_NAME (not imported: it needs verl)
CPU_MODULE = "respo_verl.verl.cpu"
PLATFORM_ENV = "VERL_PLATFORM"
MODULES_ENV = "VERL_USE_EXTERNAL_MODULES"
# Attention implementations of transformers that run on CPU tensors.
CPU_ATTENTION = ("sdpa", "eager")
# verl's file logger reads these in the TaskRunner; the driver forwards them (absolute) through Ray's runtime env.
FILE_LOGGER_ENV = ("VERL_FILE_LOGGER_ROOT", "VERL_FILE_LOGGER_PATH")


class CPUJobError(ValueError):
    """A job the CPU path cannot run, said in one line that names what to change."""


def _select(cfg: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=default)


def is_cpu_job(cfg: Any) -> bool:
    """True when the job uses the CPU rollout (what the ``device=cpu`` preset selects)."""
    return _select(cfg, "actor_rollout_ref.rollout.name") == ROLLOUT_NAME


def check_cpu_job(cfg: Any) -> None:
    """Raise :class:`CPUJobError` for a job that asks for the CPU but cannot run there.

    - ``trainer.device=cpu`` without the preset (verl would look for CUDA, NCCL and vLLM);
    - the preset without ``VERL_USE_EXTERNAL_MODULES`` naming the CPU module in Ray's runtime env (workers would not
      load it: the runtime env replaces the shell's value);
    - the preset with ``model_engine=megatron`` (the Megatron engine on CPU is not part of the preset);
    - an attention implementation or a head size that the CPU path cannot run.
    """
    device = _select(cfg, "trainer.device")
    if not is_cpu_job(cfg):
        if device == "cpu":
            raise CPUJobError(
                f"trainer.device=cpu needs the CPU preset: add {PRESET} (it sets the CPU platform, gloo, the hf_cpu "
                "rollout and the tiny model kit); see docs/cpu.md"
            )
        return
    if device != "cpu":
        raise CPUJobError(f"{PRESET} runs on the CPU only, got trainer.device={device}")
    modules = str(_select(cfg, f"ray_kwargs.ray_init.runtime_env.env_vars.{MODULES_ENV}", "") or "")
    if CPU_MODULE not in [m.strip() for m in modules.split(",")]:
        raise CPUJobError(
            f"ray_kwargs.ray_init.runtime_env.env_vars.{MODULES_ENV}={modules!r} must name {CPU_MODULE} (and the "
            f"plugin) with {PRESET}: this value replaces the shell's in every Ray process"
        )
    engines = {_select(cfg, "model_engine")} | {
        _select(cfg, f"actor_rollout_ref.{r}.strategy") for r in ("actor", "ref")
    }
    if "megatron" in engines:
        raise CPUJobError(
            f"{PRESET} runs verl's FSDP engine only; model_engine=megatron is not supported on CPU yet "
            "(see docs/cpu.md)"
        )
    attention = _select(cfg, "actor_rollout_ref.model.override_config.attn_implementation")
    if attention not in CPU_ATTENTION:
        raise CPUJobError(
            f"actor_rollout_ref.model.override_config.attn_implementation={attention} does not run on CPU; "
            f"use one of {', '.join(CPU_ATTENTION)}"
        )
    _check_model_shape(_select(cfg, "actor_rollout_ref.model.path"))


def _check_model_shape(path: Any) -> None:
    """The head size of the model at ``path`` (when it is a local HF folder) must suit rotary embeddings on CPU."""
    config_file = Path(str(path)).expanduser() / "config.json"
    if not config_file.is_file():
        return  # a kit that is not built yet, or a hub name: checked when it is loaded
    hf = json.loads(config_file.read_text())
    heads = hf.get("num_attention_heads")
    head_dim = hf.get("head_dim") or (hf["hidden_size"] // heads if heads and hf.get("hidden_size") else None)
    if head_dim is None:
        return
    if head_dim % 2:
        raise CPUJobError(
            f"{config_file}: head_dim={head_dim} is odd; rotary position embeddings need an even head size"
        )


def kit_variant(cfg: Any) -> Path | None:
    """The kit folder the job's model path points into (``<kit root>/<variant>``), or None for another model."""
    from respo_verl.cpukit.build import kit_root

    model = Path(str(_select(cfg, "actor_rollout_ref.model.path", ""))).expanduser()
    root = kit_root().resolve()
    if model.name == "model" and model.parent.parent.resolve() == root:
        return model.parent
    return None


def prepare_driver(cfg: Any) -> None:
    """Make the driver a CPU process, build the job's kit if it is missing, forward the file-logger location."""
    os.environ[PLATFORM_ENV] = "cpu"
    import importlib

    importlib.import_module(CPU_MODULE)
    variant = kit_variant(cfg)
    if variant is not None:
        from respo_verl.cpukit.build import KitSpec, build_kit

        build_kit(KitSpec(moe=variant.name == "moe"), root=variant.parent)
    forward_file_logger_env(cfg)


def forward_file_logger_env(cfg: Any) -> None:
    """Copy ``VERL_FILE_LOGGER_ROOT``/``_PATH`` of the driver into Ray's runtime env, as absolute paths."""
    from omegaconf import open_dict

    env_vars = _select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars")
    if env_vars is None:
        return
    with open_dict(env_vars):
        for name in FILE_LOGGER_ENV:
            value = os.environ.get(name)
            if value and name not in env_vars:
                env_vars[name] = str(Path(value).expanduser().resolve())
