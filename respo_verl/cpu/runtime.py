"""verl on a CPU machine: :func:`enable` switches this process to the CPU platform, gloo and the ``hf_cpu`` rollout.

It is called once per process, explicitly:

- by ``python -m respo_verl.main_ppo`` in the driver of a ``+device=cpu`` / ``+device=cpu_megatron`` job;
- in every Ray process of such a job by :mod:`respo_verl.cpu.activate`, the one module whose import has an effect:
  the presets name it in ``VERL_USE_EXTERNAL_MODULES`` of Ray's runtime env, which verl imports on ``import verl``.

Everything it does is recorded by one :class:`respo_verl.patches.Patch` (:data:`RUNTIME`, tested with verl 0.9.1)
and undone by ``RUNTIME.remove()``:

- registers the CPU platform through verl's public ``PlatformRegistry``, sets ``VERL_PLATFORM=cpu`` and makes it this
  process's platform (verl may have resolved one at import);
- applies verl 0.9.1's :data:`~respo_verl.patches.verl_0_9_1.GLOO_DEFAULT_BACKEND`,
  :data:`~respo_verl.patches.verl_0_9_1.FP32_MEGATRON_CONFIG` and
  :data:`~respo_verl.patches.verl_0_9_1.SAMPLE_REQUEST_IDS`;
- registers the ``hf_cpu`` rollout replica through the public ``RolloutReplicaRegistry`` and its adapter in verl's
  private rollout-class table (verl offers no public one);
- when verl imports its engine modules (worker processes), registers them for device ``cpu`` through the public
  ``EngineRegistry``: FSDP as verl's own classes, Megatron as :mod:`respo_verl.cpu.megatron`'s subclasses (plain,
  and with route-drift metrics under the ``routing=r2|r3`` presets' vendor).
"""

from __future__ import annotations

import os

from respo_verl.cpu.platform import PLATFORM_ENV, PLATFORM_NAME, platform_class
from respo_verl.cpu.rollout import ADAPTER_FQN, ROLLOUT_MODE, ROLLOUT_NAME, replica_class
from respo_verl.patches import Patch, verl_0_9_1

FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def _register_platform(patch: Patch) -> None:
    from verl.plugin.platform import platform_manager

    registry = platform_manager.PlatformRegistry
    previous = registry.get(PLATFORM_NAME)
    cls = registry.register(platform=PLATFORM_NAME)(platform_class())

    def unregister() -> None:
        if previous is None:
            registry._platforms.pop(PLATFORM_NAME, None)  # no public unregister
        else:
            registry.register(platform=PLATFORM_NAME)(previous)

    patch.on_remove(unregister, f"PlatformRegistry[{PLATFORM_NAME!r}]", "registered through PlatformRegistry.register")
    environ = os.environ.get(PLATFORM_ENV)
    os.environ[PLATFORM_ENV] = PLATFORM_NAME
    patch.on_remove(
        lambda: (
            os.environ.pop(PLATFORM_ENV, None) if environ is None else os.environ.__setitem__(PLATFORM_ENV, environ)
        ),
        f"os.environ[{PLATFORM_ENV!r}]",
        "verl's own switch of platform, read by processes this one starts",
    )
    patch.replace(
        platform_manager,
        "_current_platform",
        cls(),
        "verl resolves its platform once per process, possibly at import, before VERL_PLATFORM=cpu was set",
    )


def _register_rollout(patch: Patch) -> None:
    from verl.workers.rollout import base, replica

    registry = replica.RolloutReplicaRegistry
    registry.register(ROLLOUT_NAME, replica_class)
    patch.on_remove(
        lambda: registry._registry.pop(ROLLOUT_NAME, None),  # no public unregister
        f"RolloutReplicaRegistry[{ROLLOUT_NAME!r}]",
        "registered through RolloutReplicaRegistry.register",
    )
    patch.set_item(
        base._ROLLOUT_REGISTRY,
        (ROLLOUT_NAME, ROLLOUT_MODE),
        ADAPTER_FQN,
        where="verl.workers.rollout.base._ROLLOUT_REGISTRY",
        why="verl keeps its rollout classes in this private table and offers no public registration",
    )


def _register_fsdp_engines(patch: Patch) -> None:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device=PLATFORM_NAME)(engine)
        for backend in ("fsdp", "fsdp2"):
            patch.on_remove(
                lambda m=model_type, b=backend: EngineRegistry._engines[m][b].pop(PLATFORM_NAME, None),
                f"EngineRegistry[{model_type}][{backend}][{PLATFORM_NAME!r}]",
                "registered through EngineRegistry.register (no public unregister)",
            )


def _register_megatron_engines(patch: Patch) -> None:
    from respo_verl.cpu import megatron
    from respo_verl.routing import engine as route_drift

    route_drift.register_engines(patch, megatron.engine_classes(), (PLATFORM_NAME,), vendor=None)
    route_drift.register_engines(
        patch, route_drift.engine_classes(megatron.CPUMegatronEngine), (PLATFORM_NAME,), vendor=route_drift.VENDOR
    )


def _install(patch: Patch) -> None:
    _register_platform(patch)
    dependencies = (verl_0_9_1.GLOO_DEFAULT_BACKEND, verl_0_9_1.FP32_MEGATRON_CONFIG, verl_0_9_1.SAMPLE_REQUEST_IDS)
    for dependency in dependencies:
        if dependency.apply():
            patch.on_remove(dependency.remove, dependency.name)
    _register_rollout(patch)
    patch.after_import(FSDP_ENGINE_MODULE, lambda: _register_fsdp_engines(patch), "FSDP engines for device cpu")
    patch.after_import(
        verl_0_9_1.MEGATRON_ENGINE_MODULE,
        lambda: _register_megatron_engines(patch),
        "CPU Megatron engines for device cpu",
    )


RUNTIME = Patch("verl on the CPU platform (platform, gloo, hf_cpu rollout, engines)", "verl", "0.9.1", _install)


def enable() -> None:
    """Switch this process to verl on CPU (idempotent); see the module docstring."""
    RUNTIME.apply()
