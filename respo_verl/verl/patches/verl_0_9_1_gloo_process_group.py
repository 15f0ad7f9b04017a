"""The default process-group backend of verl 0.9.1's Ray workers, made valid on a CPU platform.

- verl version: 0.9.1.
- Why: ``verl.utils.distributed.initialize_global_process_group_ray`` defaults its backend to
  ``"cpu:gloo,<device>:<collective backend>"``; on the CPU platform that is ``"cpu:gloo,cpu:gloo"``, which torch
  rejects ("Duplicate device type cpu"). ``verl.workers.engine_workers`` calls it without a backend and imports it by
  name, so the default has to be fixed in ``verl.utils.distributed`` before ``engine_workers`` is imported (the
  patch also rebinds the name there if it was imported first). Only the default changes: an explicit ``backend``
  is passed through, and on any platform other than CPU the wrapper calls verl's function unchanged.
- Applied by :mod:`respo_verl.verl.cpu` (the ``cluster=cpu`` preset), never on import of respo_verl; undone by
  :func:`remove`.
- Delete when: verl builds the default backend without repeating the ``cpu`` device type.
"""

from __future__ import annotations

import functools
import sys

CPU_BACKEND = "cpu:gloo"
_MODULES = ("verl.utils.distributed", "verl.workers.engine_workers")
_original = None


def apply() -> None:
    """Wrap ``initialize_global_process_group_ray`` so that its default backend is ``cpu:gloo`` on CPU (idempotent)."""
    global _original
    if _original is not None:
        return
    from verl.utils import distributed
    from verl.utils.device import get_device_name

    original = distributed.initialize_global_process_group_ray

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None and get_device_name() == "cpu":
            backend = CPU_BACKEND
        return original(timeout_second=timeout_second, backend=backend)

    _original = original
    for name in _MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "initialize_global_process_group_ray", None) is original:
            module.initialize_global_process_group_ray = initialize_global_process_group_ray


def remove() -> None:
    """Restore verl's function wherever :func:`apply` rebound it."""
    global _original
    if _original is None:
        return
    for name in _MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "initialize_global_process_group_ray"):
            module.initialize_global_process_group_ray = _original
    _original = None
