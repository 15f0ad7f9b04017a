"""The one home of Ray's private names that respo-verl uses, each behind a guard (patches/README.md, "Ray's private
names").

Ray has no public API for these five needs, so each is reached here and nowhere else in the package. The guard is
the name itself: on first use a name that a Ray release renamed or dropped raises :class:`PrivateRayError`, which
names it, the installed Ray, the release it was tested with and what the run loses, instead of a silent no-op or an
``AttributeError`` deep in a stop. ``pyproject.toml`` bounds Ray to the releases these names were read in.
"""

from __future__ import annotations

import importlib
from typing import Any

TESTED = "2.60.0"  # the Ray release every name below was checked against (README, "Versions")


class PrivateRayError(RuntimeError):
    """A private name of Ray that respo-verl uses is not in the installed Ray."""


def _private(module: str, name: str, loses: str) -> Any:
    """``module.name`` of the installed Ray, or :class:`PrivateRayError` saying what is missing and what the run
    loses without it."""
    import ray

    found = getattr(importlib.import_module(module), name, _MISSING)
    if found is _MISSING:
        raise PrivateRayError(
            f"respo-verl uses {module}.{name}, which ray {ray.__version__} does not have (tested with ray {TESTED}): "
            f"{loses}; install ray=={TESTED} or a respo-verl release tested with ray {ray.__version__}"
        )
    return found


_MISSING = object()
_KV = "ray.experimental.internal_kv"
_KV_LOSES = "the watchdog's phase record and SIGTERM's stop request travel through the cluster's key-value store"


def kv_put(key: str, value: str, namespace: str) -> None:
    """Write ``key`` in the cluster's key-value store (the head's GCS), replacing what is there."""
    _private(_KV, "_internal_kv_put", _KV_LOSES)(key, value, overwrite=True, namespace=namespace)


def kv_get(key: str, namespace: str) -> bytes | None:
    return _private(_KV, "_internal_kv_get", _KV_LOSES)(key, namespace=namespace)


def kv_del(key: str, namespace: str) -> None:
    _private(_KV, "_internal_kv_del", _KV_LOSES)(key, namespace=namespace)


def actor_table() -> dict[str, dict]:
    """Ray's actor table from the GCS, dead actors included (with their node and cause of death), by actor id: the
    placement record a lost node's stop line and the driver's look at the set-up read. Ray's public state API
    (``ray.util.state``) needs the dashboard, which a job may run without."""
    return _private("ray._private.state", "actors", "a lost node's stop line cannot name the roles it held")()


def driver_node() -> Any:
    """This process's Ray node object (None before ``ray.init``): whether this driver started its own cluster
    (``ray_init_cluster``) and its session folder, for the reaper that stops that cluster with the driver."""
    return _private("ray._private.worker", "_global_node", "a cluster the driver starts is not stopped with it")


def stop_log_echo() -> None:
    """From now on this driver's console gets none of what Ray echoes of its workers' logs and errors (the switch
    Ray's own debugger turns, ``ray.util.rpdb``)."""
    worker = importlib.import_module("ray._private.worker")
    _private("ray._private.worker", "_worker_logs_enabled", "a stop line would be followed by the cluster's logs")
    worker._worker_logs_enabled = False


def ready(handle: Any) -> Any:
    """A call that returns once ``handle``'s actor is created and its event loop answers (Ray's built-in
    ``__ray_ready__``): an ``ObjectRef``."""
    return _method(handle, "__ray_ready__", "the liveness check of the actors a step waits on").remote()


def call(handle: Any, function: Any) -> Any:
    """``function(actor instance)`` run inside ``handle``'s actor (Ray's built-in ``__ray_call__``): an
    ``ObjectRef``."""
    loses = "the check of a rollout server's inference engine, the hf_cpu server's placement beside its worker"
    return _method(handle, "__ray_call__", loses).remote(function)


def _method(handle: Any, name: str, loses: str) -> Any:
    import ray

    method = getattr(handle, name, None)
    if method is None:
        raise PrivateRayError(
            f"respo-verl calls the built-in actor method {name}, which ray {ray.__version__} does not have (tested "
            f"with ray {TESTED}): {loses}"
        )
    return method
