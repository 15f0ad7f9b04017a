"""What a composed job needs installed on every node, and which of it the current process lacks.

:func:`job_requirements` reads the composed configuration (an OmegaConf node) and imports nothing: the planner
prints its result (``respo-verl plan``), and the per-node preflight (:mod:`respo_verl.run.preflight`) ships it to
every Ray node, where :func:`check_missing` imports each piece. Each requirement names the config key (with its
value) that makes the job need it, so that a missing piece can be fixed either way: install it, or change the key.

Which key needs what, as verl 0.9.1 and megatron-core 0.16.1 decide it:

- ``actor_rollout_ref.rollout.name``: ``vllm`` imports ``vllm``, ``sglang`` imports ``sglang``; ``hf_cpu`` is this
  package's CPU server (nothing further).
- ``model_engine=megatron`` (or an actor ``strategy`` of ``megatron``): ``megatron.core``. On CUDA, Transformer
  Engine as well: mbridge builds every layer with ``get_gpt_decoder_block_spec(..., use_transformer_engine=True)``
  (``mbridge/core/llm_bridge.py``), and verl's Megatron-Bridge path asks for ``AttnBackend.flash``, which is TE's
  ``DotProductAttention``. NVIDIA Apex is not required: megatron-core's optimizer, distributed optimizer and
  gradient clipping take Transformer Engine's fused kernels first, Apex's second, and fall back to torch
  (``megatron/core/optimizer/__init__.py``, ``distrib_optimizer.py``, ``clip_grads.py``); Apex's norm is used only
  by the local (non-TE) layer spec (``megatron/core/models/gpt/gpt_layer_specs.py``).
- ``actor_rollout_ref.actor.megatron.vanilla_mbridge``: ``true`` builds the model through ``mbridge``
  (``verl/models/mcore/mbridge.py``), ``false`` (verl's default) through Megatron-Bridge (``megatron.bridge``,
  ``verl/models/mcore/bridge.py``); verl 0.9.1's engine asserts ``use_mbridge``.
- ``...override_transformer_config.moe_token_dispatcher_type=flex``: DeepEP (``deep_ep``), for either flex backend
  (``megatron/core/transformer/moe/fused_a2a.py`` imports ``deep_ep.Buffer`` and ``deep_ep.HybridEPBuffer``).
  ``alltoall`` and ``allgather`` need nothing further.
- ``...override_transformer_config.attention_backend=flash`` (verl's default, ``trainer/config/engine/megatron.yaml``)
  on CUDA:
  megatron-core sets ``NVTE_FLASH_ATTN=1``, ``NVTE_FUSED_ATTN=0``, ``NVTE_UNFUSED_ATTN=0``
  (``megatron/core/models/common/language_module/language_module.py``), and Transformer Engine's FlashAttention
  backend then runs only with a flash-attn package installed: ``flash_attn`` (v2) or ``flash_attn_3`` (v3, sm90)
  (TE's ``pytorch/attention/dot_product_attention/utils.py``, ``get_attention_backend``: a backend whose package
  is not installed is dropped, and with fused and unfused switched off nothing is left).
- FSDP with ``actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2`` (verl's default,
  ``verl/workers/config/model.py``) on CUDA: ``flash_attn``.
- ``trainer.device=cuda``: ``torch.cuda.is_available()`` with at least ``trainer.n_gpus_per_node`` GPUs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

MEGATRON = "megatron"
CUDA = "cuda"
ACTOR_MG = "actor_rollout_ref.actor.megatron"
REF_MG = "actor_rollout_ref.ref.megatron"
TF_CONFIG = "override_transformer_config"
ROLLOUT_NAME = "actor_rollout_ref.rollout.name"
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
    """One piece a job needs on every node.

    Attributes:
        module: the import name (``deep_ep``, ``megatron.bridge``); for a GPU requirement, ``torch``.
        why_key: the config key, with its value, that makes the job need it.
        package: what to install, in words (``DeepEP``, ``Megatron-Bridge``).
        alternatives: further import names, any one of which satisfies the requirement in place of ``module``.
        gpus: for ``trainer.device=cuda``: the CUDA GPUs each node must show (``torch.cuda.device_count()``);
            0 for a package.
    """

    module: str
    why_key: str
    package: str
    alternatives: tuple[str, ...] = ()
    gpus: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        return (self.module, *self.alternatives)

    def describe(self) -> str:
        if self.gpus:
            return f"{self.gpus} CUDA GPU(s) per node"
        return f"{self.package} ({' or '.join(f'import {n}' for n in self.names)})"


def _select(cfg: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    try:
        value = OmegaConf.select(cfg, key, default=default)
    except Exception:  # an interpolation that does not resolve where this runs
        return default
    return default if value is None else value


def _is_true(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def _uses_megatron(cfg: Any) -> bool:
    return _select(cfg, "model_engine") == MEGATRON or _select(cfg, "actor_rollout_ref.actor.strategy") == MEGATRON


def _megatron_nodes(cfg: Any) -> list[str]:
    """The actor's Megatron engine node, and the ref's when the job has a Megatron reference model."""
    nodes = [ACTOR_MG]
    if _select(cfg, "actor_rollout_ref.ref.strategy") == MEGATRON and _select(cfg, REF_MG) is not None:
        nodes.append(REF_MG)
    return nodes


def _megatron_requirements(cfg: Any, cuda: bool) -> list[Requirement]:
    engine_key = (
        "model_engine=megatron"
        if _select(cfg, "model_engine") == MEGATRON
        else "actor_rollout_ref.actor.strategy=megatron"
    )
    reqs = [Requirement("megatron.core", engine_key, "megatron-core")]
    if cuda:
        reqs.append(
            Requirement(
                "transformer_engine",
                f"{engine_key} with trainer.device=cuda (mbridge and Megatron-Bridge build Transformer Engine layers)",
                "Transformer Engine",
            )
        )
    for node in _megatron_nodes(cfg):
        vanilla = _is_true(_select(cfg, f"{node}.vanilla_mbridge", False))
        if vanilla:
            reqs.append(Requirement("mbridge", f"{node}.vanilla_mbridge=true", "mbridge"))
        else:
            reqs.append(Requirement("megatron.bridge", f"{node}.vanilla_mbridge=false", "Megatron-Bridge"))
        tf = f"{node}.{TF_CONFIG}"
        dispatcher = _select(cfg, f"{tf}.moe_token_dispatcher_type")
        if dispatcher == "flex":
            backend = _select(cfg, f"{tf}.moe_flex_dispatcher_backend", "deepep")
            reqs.append(
                Requirement(
                    "deep_ep",
                    f"{tf}.moe_token_dispatcher_type=flex (moe_flex_dispatcher_backend={backend})",
                    "DeepEP",
                )
            )
        default_backend = MBRIDGE_DEFAULT_ATTENTION_BACKEND if vanilla else BRIDGE_DEFAULT_ATTENTION_BACKEND
        attention = _select(cfg, f"{tf}.attention_backend", default_backend)
        if cuda and str(attention).lower().removeprefix("attnbackend.") == "flash":
            reqs.append(
                Requirement(
                    "flash_attn",
                    f"{tf}.attention_backend=flash (Transformer Engine's flash backend)",
                    "flash-attn",
                    alternatives=("flash_attn_3",),
                )
            )
    return reqs


def job_requirements(cfg: Any) -> list[Requirement]:
    """What the composed job ``cfg`` needs importable on every node, one entry per package (first reason kept).

    Pure: reads the configuration, imports nothing but OmegaConf. See the module docstring for which key needs what.
    """
    device = str(_select(cfg, "trainer.device", CUDA))
    cuda = device == CUDA
    reqs: list[Requirement] = []
    if cuda:
        gpus = _select(cfg, "trainer.n_gpus_per_node", 1)
        gpus = gpus if isinstance(gpus, int) and gpus > 0 else 1
        reqs.append(
            Requirement("torch", f"trainer.device=cuda, trainer.n_gpus_per_node={gpus}", "CUDA torch", gpus=gpus)
        )
    rollout = _select(cfg, ROLLOUT_NAME)
    if rollout in ROLLOUT_PACKAGES:
        module, package = ROLLOUT_PACKAGES[rollout]
        reqs.append(Requirement(module, f"{ROLLOUT_NAME}={rollout}", package))
    if _uses_megatron(cfg):
        reqs.extend(_megatron_requirements(cfg, cuda))
    else:
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
    """Import each requirement in this process; one line per missing piece, naming the package and the key.

    Returns:
        ``"<package>: <why not>; needed by <key>"`` for each requirement that is not satisfied (empty: all are).
    """
    lines = []
    for req in reqs:
        if req.gpus:
            error = _gpu_error(req)
        else:
            errors = [_import_error(name) for name in req.names]
            error = (
                None
                if any(e is None for e in errors)
                else "; ".join(
                    f"{name}: {e}" if len(errors) > 1 else e for name, e in zip(req.names, errors, strict=True)
                )
            )
        if error is not None:
            lines.append(f"{req.describe()}: {error}; needed by {req.why_key}")
    return lines
