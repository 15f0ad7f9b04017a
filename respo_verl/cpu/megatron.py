"""verl's Megatron engine on the CPU platform: an engine subclass registered for device ``cpu``.

verl 0.9.1 registers its Megatron engines for ``cuda`` only (``@EngineRegistry.register(..., backend="megatron")``).
:func:`engine_classes` subclasses them; the CPU runtime registers the subclasses for device ``cpu`` through verl's
public ``EngineRegistry`` when verl imports its Megatron engine module (worker processes only). Building one is the
explicit switch for what megatron-core, mbridge and verl's engine need on CPU (:func:`enable_megatron_on_cpu`): a
process that never builds a Megatron engine is left alone, also on the FSDP CPU preset, whose workers import every
engine module too.

The subclass changes one method: the weights it hands to the rollout for syncing go through
:func:`fuse_expert_weights` (mbridge exports the checkpoint's per-expert layout, the hf_cpu rollout server holds
transformers 5's fused expert tensors).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from respo_verl.patches import mbridge_0_15_1, megatron_core_0_16_1, verl_0_9_1


def enable_megatron_on_cpu() -> None:
    """Apply megatron-core's and mbridge's CPU patches and verl's engine functions for padded CPU batches (once)."""
    megatron_core_0_16_1.CPU.apply()
    mbridge_0_15_1.LOCAL_LAYERS.apply()
    verl_0_9_1.MEGATRON_ENGINE_ON_CPU.apply()


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_weights(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF checkpoint layout (one tensor per expert and projection) -> transformers 5's in-memory expert layout.

    mbridge exports Qwen3-MoE experts as a checkpoint stores them (``...mlp.experts.<e>.{gate,up,down}_proj.weight``,
    what vLLM's loader reads); transformers 5 holds them fused per layer, ``...mlp.experts.gate_up_proj``
    (experts, 2 * moe_intermediate, hidden; gate rows first) and ``...mlp.experts.down_proj`` (experts, hidden,
    moe_intermediate), which is what the hf_cpu rollout server loads. Other tensors pass through unchanged; the fused
    ones follow once the stream ends (the server takes a whole state dict).
    """
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in named_tensors:
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
        experts.setdefault(prefix, {}).setdefault(projection, {})[expert] = tensor
    for prefix, projections in experts.items():
        ids = sorted(projections.get("down_proj", {}))
        if ids != list(range(len(ids))) or any(sorted(projections.get(p, {})) != ids for p in ("gate_proj", "up_proj")):
            raise ValueError(
                f"{prefix}: the exported experts are incomplete ({ {p: sorted(v) for p, v in projections.items()} })"
            )
        gate_up = [torch.cat([projections["gate_proj"][e], projections["up_proj"][e]], dim=0) for e in ids]
        yield f"{prefix}.gate_up_proj", torch.stack(gate_up)  # (E, 2I, H)
        yield f"{prefix}.down_proj", torch.stack([projections["down_proj"][e] for e in ids])  # (E, H, I)


class CPUMegatronEngine:
    """Mixin for verl's Megatron engines on the CPU platform (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        enable_megatron_on_cpu()
        super().__init__(*args, **kwargs)

    def get_per_tensor_param(self, *args, **kwargs):
        per_tensor_param, peft_config = super().get_per_tensor_param(*args, **kwargs)
        return fuse_expert_weights(per_tensor_param), peft_config


def engine_classes(*mixins: type) -> dict[str, type]:
    """verl's Megatron engines (language model, value model) with :class:`CPUMegatronEngine` and ``mixins``.

    ``mixins`` come first in the method order (the route-drift engine's, for ``routing=r2|r3``).
    """
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    prefix = "".join(m.__name__.removesuffix("Engine") for m in mixins)
    return {
        model_type: type(f"{prefix}CPU{base.__name__}", (*mixins, CPUMegatronEngine, base), {})
        for model_type, base in (
            ("language_model", MegatronEngineWithLMHead),
            ("value_model", MegatronEngineWithValueHead),
        )
    }
