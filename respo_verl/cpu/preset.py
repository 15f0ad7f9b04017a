"""The ``device=cpu`` preset seen from the driver: is a job a CPU job, can the CPU path run it, and its kit.

Imports neither verl nor torch (the checks run before anything heavy). :func:`respo_verl.cpu.runtime.enable` is what
switches a process to verl on CPU; :func:`prepare_driver` calls it for the driver of ``respo_verl.main_ppo``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from respo_verl.cpu import ROLLOUT_NAME
from respo_verl.entry_points import CPU_MODULE
from respo_verl.layout.parallel import STRATEGY, layout_from_config

PRESET = "+device=cpu"
MEGATRON_PRESET = "+device=cpu_megatron"
MODULES_ENV = "VERL_USE_EXTERNAL_MODULES"
# Attention implementations of transformers that run on CPU tensors.
CPU_ATTENTION = ("sdpa", "eager")
# verl's file logger reads these in the TaskRunner; the driver forwards them (absolute) through Ray's runtime env.
FILE_LOGGER_ENV = ("VERL_FILE_LOGGER_ROOT", "VERL_FILE_LOGGER_PATH")


class CPUJobError(ValueError):
    """A job the CPU path cannot run, said in one line that names what to change."""


# The samplers of a CPU job: ours (the presets' default) and verl's vLLM server on vLLM's CPU build.
VLLM = "vllm"
CPU_ROLLOUTS = (ROLLOUT_NAME, VLLM)
# Head sizes vLLM 0.24.0's CPU attention takes (CPUAttentionBackend.get_supported_head_sizes).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# What verl's vLLM server needs on a CPU, per actor_rollout_ref.rollout key: the values the CPU presets set.
VLLM_CPU_SETTINGS = {
    "enable_sleep_mode": (False, "vLLM refuses sleep mode on a CPU"),
    "free_cache_engine": (False, "freeing the KV cache between steps is sleep mode's"),
    "enforce_eager": (True, "CUDA graphs need CUDA"),
    "dtype": ("float32", "the trainer's fp32 log-probs are compared with the sampler's"),
    "checkpoint_engine.backend": ("naive", "verl's other weight transfers (CUDA IPC, NCCL, delta_sharded) need CUDA"),
}


def is_cpu_job(cfg: Any) -> bool:
    """True for a job of the CPU presets (``trainer.device=cpu``), sampled by ``hf_cpu`` or by verl's vLLM server."""
    return OmegaConf.select(cfg, "trainer.device") == "cpu"


def check_cpu_job(cfg: Any) -> None:
    """Raise :class:`CPUJobError` for a job that asks for the CPU but cannot run there.

    - ``trainer.device=cpu`` without the preset (verl would look for CUDA, NCCL and vLLM);
    - the preset without ``VERL_USE_EXTERNAL_MODULES`` naming the CPU module in Ray's runtime env (workers would not
      load it: the runtime env replaces the shell's value);
    - more worker processes (``trainer.n_gpus_per_node`` x ``trainer.nnodes``) than Ray's fake GPU slots;
    - ``model_engine=megatron`` without the Megatron CPU preset, that preset with another engine, a Megatron
      setting that megatron-core cannot run on CPU (see :data:`MEGATRON_CPU_SETTINGS`), or Transformer Engine's
      attention switches (:data:`TE_ATTENTION_ENV`) left on;
    - an attention implementation (FSDP engine) or a head size that the CPU path cannot run.
    """
    device = OmegaConf.select(cfg, "trainer.device")
    rollout = OmegaConf.select(cfg, "actor_rollout_ref.rollout.name", default=None)
    if not is_cpu_job(cfg):
        if rollout == ROLLOUT_NAME:
            raise CPUJobError(f"{PRESET} runs on the CPU only, got trainer.device={device}")
        return
    if rollout not in CPU_ROLLOUTS:
        raise CPUJobError(
            f"trainer.device=cpu needs the CPU preset: add {PRESET} (it sets the CPU platform, gloo, the hf_cpu "
            f"rollout and the tiny model kit; got actor_rollout_ref.rollout.name={rollout}, and a CPU job samples "
            f"with {' or '.join(CPU_ROLLOUTS)}); see docs/cpu.md"
        )
    modules = str(OmegaConf.select(cfg, f"ray_kwargs.ray_init.runtime_env.env_vars.{MODULES_ENV}", default="") or "")
    if CPU_MODULE not in [m.strip() for m in modules.split(",")]:
        raise CPUJobError(
            f"ray_kwargs.ray_init.runtime_env.env_vars.{MODULES_ENV}={modules!r} must name {CPU_MODULE} (and the "
            f"plugin) with {PRESET}: this value replaces the shell's in every Ray process"
        )
    slots = OmegaConf.select(cfg, "ray_kwargs.ray_init.num_gpus")
    layout = layout_from_config(cfg)
    workers = layout.world
    if slots is not None and workers > int(slots):
        raise CPUJobError(
            f"trainer.n_gpus_per_node x trainer.nnodes = {workers} worker processes, but "
            f"ray_kwargs.ray_init.num_gpus={slots}: on CPU each worker takes one of these (fake) GPU slots; set "
            f"ray_kwargs.ray_init.num_gpus={workers}"
        )
    megatron = layout.backend == "megatron"
    engine, ref = OmegaConf.select(cfg, "model_engine"), OmegaConf.select(cfg, "actor_rollout_ref.ref.strategy")
    if {engine == "megatron", ref == "megatron"} != {megatron}:  # each CPU preset sets all three to one engine
        raise CPUJobError(
            f"verl's Megatron engine on CPU needs {MEGATRON_PRESET} together with model_engine=megatron (got "
            f"model_engine={engine}, actor/ref strategy {OmegaConf.select(cfg, STRATEGY)}/{ref}; {PRESET} is the "
            "FSDP engine's preset); see docs/cpu-megatron.md"
        )
    if megatron:
        _check_megatron_cpu_job(cfg)
    else:
        attention = OmegaConf.select(cfg, "actor_rollout_ref.model.override_config.attn_implementation")
        if attention not in CPU_ATTENTION:
            raise CPUJobError(
                f"actor_rollout_ref.model.override_config.attn_implementation={attention} does not run on CPU; "
                f"use one of {', '.join(CPU_ATTENTION)}"
            )
    if rollout == VLLM:
        _check_vllm_cpu_job(cfg)
    _check_model_shape(OmegaConf.select(cfg, "actor_rollout_ref.model.path"), vllm=rollout == VLLM)


def _check_vllm_cpu_job(cfg: Any) -> None:
    for key, (value, reason) in VLLM_CPU_SETTINGS.items():
        full_key = f"actor_rollout_ref.rollout.{key}"
        got = OmegaConf.select(cfg, full_key)
        if got != value:
            raise CPUJobError(
                f"{full_key}={got} does not run with vLLM on a CPU ({reason}); the CPU presets set {value}"
            )


# What megatron-core 0.16.1 and mbridge need to run on CPU (no Transformer Engine, no CUDA), per role
# (actor_rollout_ref.<role>.megatron.<key>): the values the +device=cpu_megatron preset sets.
MEGATRON_CPU_SETTINGS = {
    "vanilla_mbridge": (True, "HF weights go through mbridge; Megatron-Bridge is not installed on CPU"),
    "dtype": ("fp32", "the precision tested on CPU; megatron-core's bf16/fp16 optimizer is untested on the host"),
    "override_transformer_config.attention_backend": ("local", "flash and Transformer Engine attention need CUDA"),
    "override_transformer_config.moe_grouped_gemm": (False, "grouped GEMMs need Transformer Engine"),
    "override_transformer_config.gradient_accumulation_fusion": (False, "a CUDA extension"),
    "pad_bshd_to_minibatch_max": (
        False,
        "routing replay on a padded batch lays routes out for each micro-batch's own longest sample",
    ),
}


def _check_megatron_cpu_job(cfg: Any) -> None:
    _check_attention_env(cfg)
    for role in ("actor", "ref"):
        for key, (value, reason) in MEGATRON_CPU_SETTINGS.items():
            full_key = f"actor_rollout_ref.{role}.megatron.{key}"
            got = OmegaConf.select(cfg, full_key)
            if got != value and not (key == "dtype" and str(got) in ("fp32", "float32")):
                raise CPUJobError(f"{full_key}={got} does not run on CPU ({reason}); {MEGATRON_PRESET} sets {value}")


# Transformer Engine's attention switches. megatron-core asserts that each is unset or 0 when it builds a model with
# the local attention backend, and a process that built a model with another backend leaves them set to 1.
TE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def _check_attention_env(cfg: Any) -> None:
    runtime_env = OmegaConf.select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars") or {}
    for name in TE_ATTENTION_ENV:
        for where, value in (("the environment", os.environ.get(name)), ("Ray's runtime env", runtime_env.get(name))):
            if value not in (None, "0", 0):
                raise CPUJobError(
                    f"{name}={value} in {where} conflicts with the local attention backend of {MEGATRON_PRESET} "
                    "(megatron-core requires it unset or 0); unset it"
                )


def _check_model_shape(path: Any, vllm: bool = False) -> None:
    """The head size of the model at ``path`` (when it is a local HF folder) must suit rotary embeddings on CPU, and
    with ``vllm`` vLLM's CPU attention."""
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
    if vllm and head_dim not in VLLM_CPU_HEAD_SIZES:
        raise CPUJobError(
            f"{config_file}: head_dim={head_dim} is not a head size of vLLM's CPU attention "
            f"({', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); sample this model with rollout.name={ROLLOUT_NAME}"
        )


def kit_variant(cfg: Any) -> Path | None:
    """The kit folder the job's model path points into (``<kit root>/<variant>``), or None for another model."""
    from respo_verl.cpu.kit.build import kit_root

    model = Path(str(OmegaConf.select(cfg, "actor_rollout_ref.model.path", default=""))).expanduser()
    root = kit_root().resolve()
    if model.name == "model" and model.parent.parent.resolve() == root:
        return model.parent
    return None


def prepare_driver(cfg: Any) -> None:
    """Make the driver a CPU process, build the job's kit if it is missing, forward the file-logger location."""
    from respo_verl.cpu.runtime import enable

    enable()
    variant = kit_variant(cfg)
    if variant is not None:
        from respo_verl.cpu.kit.build import build_kit, spec_of

        build_kit(spec_of(variant.name), root=variant.parent)
    forward_file_logger_env(cfg)


def forward_file_logger_env(cfg: Any) -> None:
    """Copy ``VERL_FILE_LOGGER_ROOT``/``_PATH`` of the driver into Ray's runtime env, as absolute paths."""
    from omegaconf import open_dict

    env_vars = OmegaConf.select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars")
    if env_vars is None:
        return
    with open_dict(env_vars):
        for name in FILE_LOGGER_ENV:
            value = os.environ.get(name)
            if value and name not in env_vars:
                env_vars[name] = str(Path(value).expanduser().resolve())
