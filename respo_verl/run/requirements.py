"""What a composed job needs installed on every node, and which of it the current process lacks.

:func:`job_requirements` reads the composed configuration, its layout too (:mod:`respo_verl.layout.parallel`);
:func:`check_missing` imports each piece where it runs (docs/gpu.md, "The preflight: what every node must have").
Each requirement names the key that makes the job need it, so that a missing piece can be fixed either way: install
it, or change the key; where verl 0.9.1, megatron-core 0.16.1 and Transformer Engine decide it is said next to each
requirement below.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from respo_verl.layout.parallel import ROLLOUT, STRATEGY, layout_from_config

MEGATRON = "megatron"
CUDA = "cuda"
ACTOR_MG = "actor_rollout_ref.actor.megatron"
REF_MG = "actor_rollout_ref.ref.megatron"
TF_CONFIG = "override_transformer_config"
ROLLOUT_NAME = f"{ROLLOUT}.name"
ATTN_IMPLEMENTATION = "actor_rollout_ref.model.override_config.attn_implementation"
# verl 0.9.1: HFModelConfig's attention implementation when override_config does not set one.
VERL_DEFAULT_ATTN_IMPLEMENTATION = "flash_attention_2"
# When override_transformer_config has no attention_backend (verl's engine/megatron.yaml sets flash): verl 0.9.1's
# Megatron-Bridge path (transformer_impl.py) asks for flash, the mbridge path leaves megatron-core's default (auto).
BRIDGE_DEFAULT_ATTENTION_BACKEND = "flash"
MBRIDGE_DEFAULT_ATTENTION_BACKEND = "auto"

# rollout name -> (import name, what to install)
ROLLOUT_PACKAGES = {"vllm": ("vllm", "vLLM"), "sglang": ("sglang", "SGLang")}


@dataclass(frozen=True)
class Requirement:
    """One piece a job needs on every node."""

    module: str  # the import name (deep_ep, megatron.bridge); for a GPU requirement, torch
    why_key: str  # the config key, with its value, that makes the job need it
    package: str  # what to install, in words (DeepEP, Megatron-Bridge)
    alternatives: tuple[str, ...] = ()  # further import names, any one of which satisfies it in place of module
    gpus: int = 0  # trainer.device=cuda: the CUDA GPUs each node must show (torch.cuda.device_count()); 0: a package

    @property
    def names(self) -> tuple[str, ...]:
        return (self.module, *self.alternatives)

    def describe(self) -> str:
        if self.gpus:
            return f"{self.gpus} CUDA GPU(s) per node"
        return f"{self.package} ({' or '.join(f'import {n}' for n in self.names)})"


def _select(cfg: Any, key: str, default: Any = None) -> Any:
    """``key`` of ``cfg``, or ``default`` where it is unset, null or an interpolation unresolved where this runs."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
    return default if value is None else value


def _megatron_requirements(cfg: Any, cuda: bool) -> Iterator[Requirement]:
    """What a Megatron job needs; NVIDIA Apex is not among it: megatron-core falls back to torch where Apex is absent
    (``megatron/core/optimizer/``, docs/gpu.md, "The preflight: what every node must have")."""
    engine_key = f"{STRATEGY}={MEGATRON}"
    yield Requirement("megatron.core", engine_key, "megatron-core")
    if cuda:
        # mbridge builds every layer with get_gpt_decoder_block_spec(..., use_transformer_engine=True)
        # (mbridge/core/llm_bridge.py); verl's Megatron-Bridge path asks for AttnBackend.flash, which is TE's
        # DotProductAttention.
        yield Requirement(
            "transformer_engine",
            f"{engine_key} with trainer.device=cuda (mbridge and Megatron-Bridge build Transformer Engine layers)",
            "Transformer Engine",
        )
    nodes = [ACTOR_MG]  # and the reference model's, when it is a Megatron one too
    if _select(cfg, "actor_rollout_ref.ref.strategy") == MEGATRON and _select(cfg, REF_MG) is not None:
        nodes.append(REF_MG)
    for node in nodes:
        # true builds the model through mbridge (verl/models/mcore/mbridge.py), false (verl's default) through
        # Megatron-Bridge (verl/models/mcore/bridge.py); verl 0.9.1's engine asserts use_mbridge.
        vanilla = str(_select(cfg, f"{node}.vanilla_mbridge", False)).lower() == "true"
        if vanilla:
            yield Requirement("mbridge", f"{node}.vanilla_mbridge=true", "mbridge")
        else:
            yield Requirement("megatron.bridge", f"{node}.vanilla_mbridge=false", "Megatron-Bridge")
        tf = f"{node}.{TF_CONFIG}"
        dispatcher = _select(cfg, f"{tf}.moe_token_dispatcher_type")
        if dispatcher == "flex":  # either flex backend: moe/fused_a2a.py imports deep_ep.Buffer and HybridEPBuffer
            backend = _select(cfg, f"{tf}.moe_flex_dispatcher_backend", "deepep")
            yield Requirement(
                "deep_ep",
                f"{tf}.moe_token_dispatcher_type=flex (moe_flex_dispatcher_backend={backend})",
                "DeepEP",
            )
        default_backend = MBRIDGE_DEFAULT_ATTENTION_BACKEND if vanilla else BRIDGE_DEFAULT_ATTENTION_BACKEND
        attention = _select(cfg, f"{tf}.attention_backend", default_backend)
        # With flash, megatron-core sets NVTE_FLASH_ATTN=1, NVTE_FUSED_ATTN=0, NVTE_UNFUSED_ATTN=0 (language_module.py),
        # and TE's get_attention_backend drops a backend whose package is not installed: nothing would be left.
        if cuda and str(attention).lower().removeprefix("attnbackend.") == "flash":
            yield Requirement(
                "flash_attn",
                f"{tf}.attention_backend=flash (Transformer Engine's flash backend)",
                "flash-attn",
                alternatives=("flash_attn_3",),
            )


def job_requirements(cfg: Any) -> list[Requirement]:
    """What the composed job ``cfg`` needs importable on every node, one entry per package (first reason kept)."""
    cuda, layout = str(_select(cfg, "trainer.device", CUDA)) == CUDA, layout_from_config(cfg)
    reqs: list[Requirement] = []
    if cuda:
        gpus = max(layout.gpus_per_node, 1)
        reqs.append(
            Requirement("torch", f"trainer.device=cuda, trainer.n_gpus_per_node={gpus}", "CUDA torch", gpus=gpus)
        )
    if layout.rollout_name in ROLLOUT_PACKAGES:
        module, package = ROLLOUT_PACKAGES[layout.rollout_name]
        reqs.append(Requirement(module, f"{ROLLOUT_NAME}={layout.rollout_name}", package))
    megatron = list(_megatron_requirements(cfg, cuda)) if layout.backend == MEGATRON else []
    reqs.extend(megatron)
    if not megatron:  # FSDP: HFModelConfig's attention implementation
        set_attn = _select(cfg, ATTN_IMPLEMENTATION)
        attn = set_attn or VERL_DEFAULT_ATTN_IMPLEMENTATION
        if cuda and attn == "flash_attention_2":
            origin = "" if set_attn else " (verl's default)"
            reqs.append(Requirement("flash_attn", f"{ATTN_IMPLEMENTATION}=flash_attention_2{origin}", "flash-attn"))
    unique: dict[tuple[str, ...], Requirement] = {}
    for req in reqs:
        unique.setdefault(req.names, req)
    return list(unique.values())


def install_line(reqs: list[Requirement]) -> str:
    """One line naming what ``reqs`` needs installed, e.g. for ``respo-verl plan``."""
    items = [r.describe() for r in reqs]
    return "needs installed: " + (", ".join(items) if items else "nothing beyond respo-verl and verl")


def _import_error(name: str) -> str | None:
    """None when ``name`` imports in this process, else why not (one line)."""
    try:
        if importlib.util.find_spec(name) is None:
            return "not installed"
    except Exception as exc:  # a parent package that is absent or broken
        return f"not installed ({type(exc).__name__}: {exc})".splitlines()[0]
    try:
        importlib.import_module(name)
    except Exception as exc:  # a broken install raises more than ImportError (OSError, RuntimeError, ...)
        return f"import fails ({type(exc).__name__}: {exc})".splitlines()[0]
    return None


def _gpu_error(req: Requirement) -> str | None:
    try:
        import torch
    except Exception as exc:
        return f"torch does not import ({type(exc).__name__}: {exc})".splitlines()[0]
    # A node restricted to fewer devices says so: the count below is of the devices this variable leaves visible.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    restricted = "" if visible is None else f" with CUDA_VISIBLE_DEVICES={visible!r}"
    try:
        if not torch.cuda.is_available():
            return f"torch {torch.__version__} sees no CUDA device{restricted} (torch.cuda.is_available() is False)"
        count = torch.cuda.device_count()
    except Exception as exc:
        return f"CUDA does not initialise ({type(exc).__name__}: {exc})".splitlines()[0]
    if count < req.gpus:
        return f"torch sees {count} CUDA GPU(s){restricted}, fewer than {req.gpus}"
    return None


def check_missing(reqs: list[Requirement]) -> list[str]:
    """Import each requirement in this process: ``"<package>: <why not>; needed by <key>"`` for each one that is not
    satisfied (empty: all are)."""
    lines = []
    for req in reqs:
        if req.gpus:
            error = _gpu_error(req)
        else:
            errors = {name: _import_error(name) for name in req.names}
            named = [f"{name}: {e}" if len(errors) > 1 else e for name, e in errors.items()]
            error = None if None in errors.values() else "; ".join(named)
        if error is not None:
            lines.append(f"{req.describe()}: {error}; needed by {req.why_key}")
    return lines
