"""Patch of verl 0.9.1: route-drift metrics from the Megatron engine (``actor/routing/...``).

- **Base:** verl 0.9.1, ``verl/workers/engine/megatron/transformer_impl.py``, ``MegatronEngine.forward_backward_batch``
  (the method that sets the routing-replay actions, runs megatron's pipeline schedule and clears the replay data).
- **Why:** verl has no hook around one engine step, and no way to add metrics from outside the loss function, which
  sees one micro-batch and no routers. Route drift has to be read on the routers of the model being forwarded, after
  all micro-batches, and summed over ranks before it becomes a ratio.
- **Delete when:** verl reports route drift (or replay statistics) from its Megatron engine itself, or offers a
  per-step hook on the engine that can add metrics.

What it does. :func:`apply` replaces ``MegatronEngine.forward_backward_batch`` by a wrapper, once (idempotent);
:func:`remove` puts the original back and unhooks every router. The wrapper costs one attribute lookup on an engine
with routing replay off (verl's ``engine.enable_routing_replay``) or on a call whose batch does not ask for replay
(verl's ``enable_routing_replay`` batch flag: off for the reference model). Otherwise it attaches a
:class:`respo_verl.megatron.routing.RouteDriftMonitor` to ``engine.module`` (its own model chunks, walked for their
routers; re-attached if the engine rebuilds its model) and runs the original inside ``monitor.step()``. Bad replay
data raises there, naming the layer.

Where the numbers go. verl's trainer prefixes ``update_actor`` metrics with ``actor/`` and, of ``compute_log_prob``'s
metrics, keeps only ``mfu``. So:

- a training call (``update_actor``, one call per mini-batch) reports ``routing/...``: the replay of that mini-batch
  against the live router of π_θ (R2: π_old's routes; R3: the rollout's routes);
- a forward-only call (``compute_log_prob``) that replayed anything (R3: the rollout's routes against π_old's router;
  R2's old-log-prob pass records and replays nothing) is kept on the device, no host sync, and reported with the
  next training call as ``routing/compute_log_prob/...``, summed over all forward-only calls since the last one
  (absent when none replayed anything).

Per-layer sums are added over all ranks by :func:`respo_verl.megatron.routing.reduce_route_drift` (a small
``all_reduce`` per training call, every rank of the engine's world takes part) before the ratios are formed; with
PP > 1 ``any_layer_flip_frac`` is reported per stage (the whole-model value is at least their maximum). The values
are scalars per mini-batch, handed to verl as one-element lists like its micro-batch metrics; the trainer's mean
over mini-batches is therefore a mean of per-mini-batch ratios.

Switching it on: :func:`maybe_apply` (called by the plugin on import in every verl process) applies the patch only
if the environment variable ``RESPO_VERL_ROUTING_DIAGNOSTICS`` is ``1``/``true``; the ``routing=r2`` and
``routing=r3`` presets put it into Ray's runtime env (``ray_kwargs.ray_init.runtime_env.env_vars``).
The plugin is loaded before any config exists, so the environment is the only switch it can read.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "RESPO_VERL_ROUTING_DIAGNOSTICS"
TRAIN_PREFIX = "routing"  # verl's trainer adds "actor/"
LOG_PROB_PREFIX = "routing/compute_log_prob"
_STATE_ATTR = "_respo_route_drift"
_ORIGINAL_ATTR = "__respo_original__"
_states: weakref.WeakSet = weakref.WeakSet()  # per-engine states, only so that remove() can unhook their routers


def enabled_by_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``RESPO_VERL_ROUTING_DIAGNOSTICS`` asks for the diagnostics (``1``, ``true``, ``yes``, ``on``)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _engine_class():
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    return MegatronEngine


def is_applied() -> bool:
    """Whether ``MegatronEngine.forward_backward_batch`` is our wrapper (imports verl's Megatron engine)."""
    return hasattr(vars(_engine_class())["forward_backward_batch"], _ORIGINAL_ATTR)


def apply() -> bool:
    """Install the wrapper on ``MegatronEngine`` (idempotent).

    Returns:
        True if it was installed by this call, False if it was already in place.
    """
    engine_cls = _engine_class()
    original = vars(engine_cls)["forward_backward_batch"]
    if hasattr(original, _ORIGINAL_ATTR):
        return False
    engine_cls.forward_backward_batch = _make_wrapper(original)
    return True


def remove() -> bool:
    """Put verl's method back and unhook the routers of every engine the wrapper has seen (idempotent).

    Returns:
        True if the wrapper was installed and is now removed.
    """
    for state in list(_states):
        state.close()
    engine_cls = _engine_class()
    current = vars(engine_cls)["forward_backward_batch"]
    if not hasattr(current, _ORIGINAL_ATTR):
        return False
    engine_cls.forward_backward_batch = getattr(current, _ORIGINAL_ATTR)
    return True


def maybe_apply(environ: Mapping[str, str] | None = None) -> bool:
    """Apply the patch if the environment asks for it; the plugin's entry point.

    Returns:
        Whether the patch is in place afterwards. False without asking verl's engine module when switched off.
    """
    if not enabled_by_env(environ):
        return False
    try:
        apply()
    except ImportError as exc:  # a process without megatron-core never builds a MegatronEngine
        logger.warning("%s is set but verl's Megatron engine cannot be imported here (%s); not patched", ENV_VAR, exc)
        return False
    return True


def _make_wrapper(original):
    from verl.utils import tensordict_utils as tu

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        state = self.__dict__.get(_STATE_ATTR)
        if state is None:
            state = _EngineRouteDrift() if getattr(self, "enable_routing_replay", False) else False
            self.__dict__[_STATE_ATTR] = state
        if state is False or not tu.get_non_tensor_data(data, key="enable_routing_replay", default=False):
            return original(self, data, loss_function, forward_only)
        return state.run(original, self, data, loss_function, forward_only)

    forward_backward_batch.__doc__ = original.__doc__
    forward_backward_batch.__name__ = original.__name__
    forward_backward_batch.__qualname__ = original.__qualname__
    setattr(forward_backward_batch, _ORIGINAL_ATTR, original)
    return forward_backward_batch


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b


class _EngineRouteDrift:
    """Route-drift bookkeeping of one engine: its monitor and the forward-only sums not reported yet."""

    def __init__(self):
        self.module = None
        self.monitor = None
        self.pending: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        _states.add(self)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.remove()
        self.module, self.monitor, self.pending = None, None, (None, None)

    def _attach(self, module) -> None:
        from respo_verl.megatron.routing import RouteDriftMonitor, find_replay_routers

        if module is self.module:
            return
        self.close()
        self.module = module
        # A pipeline stage may hold no MoE layer: no monitor, but it still takes part in the all_reduce.
        self.monitor = RouteDriftMonitor.attach(module) if find_replay_routers(module) else None

    def run(self, original, engine, data, loss_function, forward_only):
        self._attach(engine.module)
        if self.monitor is None:
            output = original(engine, data, loss_function, forward_only)
            sums = (None, None)
        else:
            with self.monitor.step():
                output = original(engine, data, loss_function, forward_only)
            sums = self.monitor.sums(reset=True)
        if forward_only:
            self.pending = (_add(self.pending[0], sums[0]), _add(self.pending[1], sums[1]))
            return output
        log_prob_sums, self.pending = self.pending, (None, None)
        metrics = self._reduce(engine, {TRAIN_PREFIX: sums, LOG_PROB_PREFIX: log_prob_sums})
        if metrics and engine.is_mp_src_rank_with_outputs() and isinstance(output, dict) and "metrics" in output:
            # One-element lists, the shape of verl's per-micro-batch metrics (worker flattens, trainer averages).
            output["metrics"].update({key: [value] for key, value in metrics.items()})
        return output

    def _reduce(self, engine, sums_by_prefix: dict) -> dict[str, float]:
        from respo_verl.megatron.routing import reduce_route_drift

        return reduce_route_drift(
            self.monitor.layers if self.monitor is not None else (),
            sums_by_prefix,
            self._device(engine, sums_by_prefix),
            sequence_parallel=bool(getattr(engine.tf_config, "sequence_parallel", False)),
            optional_prefixes=(LOG_PROB_PREFIX,),  # no replaying forward-only call since the last update: no keys
        )

    def _device(self, engine, sums_by_prefix: dict) -> torch.device:
        for per_layer, _ in sums_by_prefix.values():
            if per_layer is not None:
                return per_layer.device
        chunks = engine.module if isinstance(engine.module, list | tuple) else [engine.module]
        for chunk in chunks:
            for param in chunk.parameters():
                return param.device  # on the accelerator during a step (verl loads offloaded params first)
        return torch.device("cpu")
