"""verl's Megatron engine on the CPU platform: an engine subclass registered for device ``cpu``.

verl 0.9.1 registers its Megatron engines for ``cuda`` only (``@EngineRegistry.register(..., backend="megatron")``).
:func:`engine_classes` subclasses them; the CPU runtime registers the subclasses for device ``cpu`` through verl's
public ``EngineRegistry`` when verl imports its Megatron engine module (worker processes only). Building one is the
explicit switch for what megatron-core, mbridge and verl's engine need on CPU (:func:`enable_megatron_on_cpu`): a
process that never builds a Megatron engine is left alone, also on the FSDP CPU preset, whose workers import every
engine module too.

The weights it hands the rollout are mbridge's export, in the checkpoint's per-expert layout, which is what vLLM's
loader reads; the hf_cpu server fuses them into transformers 5's layout itself
(:func:`respo_verl.cpu.rollout.fuse_expert_weights`).
"""

from __future__ import annotations

from respo_verl.patches import mbridge_0_15_1, megatron_core_0_16_1, verl_0_9_1


def enable_megatron_on_cpu() -> None:
    """Apply megatron-core's and mbridge's CPU patches (the distributed optimizer's included) and verl's engine
    functions for padded CPU batches (once)."""
    megatron_core_0_16_1.CPU.apply()
    megatron_core_0_16_1.DISTRIBUTED_OPTIMIZER.apply()
    mbridge_0_15_1.LOCAL_LAYERS.apply()
    verl_0_9_1.MEGATRON_ENGINE_ON_CPU.apply()


class CPUMegatronEngine:
    """Mixin for verl's Megatron engines on the CPU platform (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        enable_megatron_on_cpu()
        super().__init__(*args, **kwargs)


def engine_classes() -> dict[str, type]:
    """verl's Megatron engines (language model, value model) with :class:`CPUMegatronEngine` (the route-drift
    engines on CPU are :func:`respo_verl.routing.engine.engine_classes` with it as a mixin)."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    return {
        model_type: type(f"CPU{base.__name__}", (CPUMegatronEngine, base), {})
        for model_type, base in (
            ("language_model", MegatronEngineWithLMHead),
            ("value_model", MegatronEngineWithValueHead),
        )
    }
