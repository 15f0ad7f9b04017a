"""verl's platform for a machine without accelerators: device ``cpu``, gloo collectives.

verl resolves its device through ``verl.plugin.platform`` and knows CUDA, NPU and ROCm only; with no accelerator it
falls back to CUDA. Its trainer, workers and FSDP engines otherwise run on CPU tensors with a gloo process group.
:func:`platform_class` is the platform that :mod:`respo_verl.cpu.runtime` registers through verl's public
``PlatformRegistry`` (a Ray "GPU" resource that the ``+device=cpu`` preset fakes with ``ray_init.num_gpus``).
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Any

import torch

PLATFORM_NAME = "cpu"
PLATFORM_ENV = "VERL_PLATFORM"  # verl's own switch of platform
# The Ray resource verl's worker groups ask for; on CPU the preset declares one fake "GPU" per process slot.
RAY_RESOURCE = "GPU"
CPU_DEVICE = "cpu"


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _device_module() -> types.ModuleType:
    """A ``torch.cuda``-shaped namespace for the CPU: memory, cache and stream calls that verl makes are no-ops.

    Everything else is looked up on ``torch.cpu``; a name that neither has raises AttributeError naming it.
    """
    module = types.ModuleType("respo_verl_cpu_device")
    module.__dict__.update(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: CPU_DEVICE,
        set_device=_noop,
        synchronize=_noop,
        empty_cache=_noop,
        ipc_collect=_noop,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
        memory_allocated=_zero,
        max_memory_allocated=_zero,
        memory_reserved=_zero,
        max_memory_reserved=_zero,
        reset_peak_memory_stats=_noop,
        mem_get_info=lambda *a, **k: (0, 0),
        get_device_name=lambda *a, **k: "cpu",
    )

    def __getattr__(name: str) -> Any:
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        raise AttributeError(f"the CPU device module has no {name!r} (neither respo_verl's CPU platform nor torch.cpu)")

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return module


def platform_class() -> type:
    """The ``PlatformBase`` subclass for the CPU (built lazily: importing this module does not import verl)."""
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform for a machine without accelerators: device ``cpu``, gloo collectives."""

        _module = _device_module()

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            return self._module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            # Only chosen explicitly (VERL_PLATFORM=cpu): auto-detection must keep preferring real accelerators.
            return False

        def current_device(self) -> str:
            # verl passes this straight to .to()/to_empty(); an int there would mean an accelerator index.
            return CPU_DEVICE

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            # Ray sets it for actors holding a (fake) GPU; a CPU build of torch ignores it.
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return RAY_RESOURCE

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU
