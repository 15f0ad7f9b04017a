"""The route-drift Megatron engine: verl's Megatron engine that reports route drift (``actor/routing/...``).

verl 0.9.1 has no hook around one engine step and no way to add metrics from outside the loss function, which sees
one micro-batch and no routers. Route drift has to be read on the routers of the model being forwarded, after all
micro-batches, and summed over ranks before it becomes a ratio. So :class:`RouteDriftEngine` overrides
``MegatronEngine.forward_backward_batch`` in a subclass, and :data:`REGISTRATION` registers the subclasses through
verl's public ``EngineRegistry`` under the vendor :data:`VENDOR`, which the ``routing=r2|r3`` presets select with
verl's own ``VERL_ENGINE_VENDOR``. Other engines, other vendors and other processes are untouched; the plugin
applies :data:`REGISTRATION`, which waits until verl imports its Megatron engine module (trainer workers only:
nothing heavy is imported in the driver, the TaskRunner or the rollout). A failure to register them is a
:class:`RouteDriftRegistrationError` raised from that import, in the trainer worker that builds the engine: it stops
the trainer with the cause; the rollout never imports the Megatron engine and is not affected.

What it does. With routing replay off (verl's ``engine.enable_routing_replay``) or on a call whose batch does not ask
for replay (verl's ``enable_routing_replay`` batch flag: off for the reference model) the subclass calls verl's
method and nothing else. Otherwise it attaches a :class:`respo_verl.routing.megatron.RouteDriftMonitor` to
``engine.module`` (its own model chunks, walked for their routers; re-attached if the engine rebuilds its model)
and runs verl's method inside ``monitor.step()``. Bad replay data raises there, naming the layer; the batch's
``routed_experts`` are checked for expert indices out of range on the host first (one reduction and one host copy
per call), which names the layer on CUDA too and spares the routers their own check (a host sync per router).

Where the numbers go. verl's trainer prefixes ``update_actor`` metrics with ``actor/`` and, of ``compute_log_prob``'s
metrics, keeps only ``mfu``. So:

- a training call (``update_actor``, one call per mini-batch) reports ``routing/...``: the replay of that mini-batch
  against the live router of π_θ (R2: π_old's routes; R3: the rollout's routes);
- a forward-only call (``compute_log_prob``) that replayed anything (R3: the rollout's routes against π_old's router;
  R2's old-log-prob pass records and replays nothing) is kept on the device, no host sync, and reported with the
  next training call as ``routing/compute_log_prob/...``, summed over all forward-only calls since the last one
  (absent when none replayed anything).

R3's routes themselves are counted too: the forward-only calls' ``routed_experts`` bytes, reported with the next
training call as ``routing/compute_log_prob/route_bytes`` (summed over the data-parallel group), ``..._per_sample``
and ``..._max_rank`` (:func:`route_bytes_metrics`). :data:`REGISTRATION` also applies
:data:`respo_verl.patches.verl_0_9_1_routes.ROUTES_UINT8`, which keeps them uint8 on their way.

Per-layer sums are added over all ranks by :func:`respo_verl.routing.megatron.reduce_route_drift` (a small
``all_reduce`` per training call, every rank of the engine's world takes part) before the ratios are formed; with
PP > 1 ``any_layer_flip_frac`` is reported per stage (the whole-model value is at least their maximum). The values
are scalars per mini-batch, handed to verl as one-element lists like its micro-batch metrics; the trainer's mean
over mini-batches is therefore a mean of per-mini-batch ratios.

By update index. That mean hides how drift grows with staleness, so each training call's whole-model metrics are
logged a second time under ``routing/by_update/j<j>/...``
(:func:`respo_verl.routing.diagnostics.per_update_metrics`), with j the call's index in the step's update pass:
0 for the first mini-batch on a rollout batch, N − 1 for the last (N·epochs − 1 with ``ppo_epochs`` > 1). verl's
worker runs one ``train_batch`` per mini-batch and marks the last of the pass with the batch flag
``update_lr_scheduler``, so the engine counts training calls and starts again at 0 after that flag: host-side
bookkeeping of a non-tensor flag, no host sync. A replaying forward-only call (the next rollout batch's
old-log-prob pass, which records R2's routes) also starts it again, for a caller that sets no such flag. Each j's
key appears once per step, so the trainer's mean over the step's mini-batches is that j's value.

Delete when: verl reports route drift (or replay statistics) from its Megatron engine itself, or offers a per-step
hook on the engine that can add metrics.
"""

from __future__ import annotations

import torch

from respo_verl.patches import Patch

# verl's VERL_ENGINE_VENDOR value that selects these engines (set by configs/routing/r2.yaml and r3.yaml).
VENDOR = "respo_route_drift"
VENDOR_ENV = "VERL_ENGINE_VENDOR"
# The devices whose Megatron engine gets a route-drift variant here; the CPU runtime registers its own for "cpu".
DEVICES = ("cuda",)
TRAIN_PREFIX = "routing"  # verl's trainer adds "actor/"
LOG_PROB_PREFIX = "routing/compute_log_prob"
MEGATRON_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"


class RouteDriftEngine:
    """Mixin for verl's Megatron engines: route-drift metrics in every training call that replays routes."""

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        from verl.utils import tensordict_utils as tu

        state = self.__dict__.get("_route_drift")
        if state is None:
            state = _EngineRouteDrift() if getattr(self, "enable_routing_replay", False) else False
            self.__dict__["_route_drift"] = state
        parent = super().forward_backward_batch
        if state is False or not tu.get_non_tensor_data(data, key="enable_routing_replay", default=False):
            return parent(data, loss_function, forward_only)
        return state.run(parent, self, data, loss_function, forward_only)


def engine_classes(*mixins: type) -> dict[str, type]:
    """verl's Megatron engines (language model, value model) with :class:`RouteDriftEngine` and ``mixins``."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    return {
        model_type: type(f"RouteDrift{base.__name__}", (RouteDriftEngine, *mixins, base), {})
        for model_type, base in (
            ("language_model", MegatronEngineWithLMHead),
            ("value_model", MegatronEngineWithValueHead),
        )
    }


def register_engines(
    patch: Patch, classes: dict[str, type], devices: tuple[str, ...], vendor: str | None = VENDOR
) -> None:
    """Register ``classes`` (by model type) for ``devices`` and ``vendor`` (None: the device's default) in verl's
    EngineRegistry, recorded in ``patch`` for removal."""
    from verl.workers.engine.base import EngineRegistry

    for model_type, engine in classes.items():
        EngineRegistry.register(model_type=model_type, backend="megatron", device=list(devices), vendor=vendor)(engine)
        for device in devices:
            key = (device, vendor) if vendor else device
            patch.on_remove(
                # verl's registry has no public unregister: removal reads its private table.
                lambda model_type=model_type, key=key: EngineRegistry._engines[model_type]["megatron"].pop(key, None),
                where=f"EngineRegistry[{model_type}][megatron][{key}]",
                why="registered through EngineRegistry.register",
            )


class RouteDriftRegistrationError(RuntimeError):
    """The route-drift engines could not be registered once verl imported its Megatron engine.

    A RuntimeError, not an ImportError: verl's ``verl.workers.engine`` turns an ImportError of its Megatron engine
    into a warning and goes on without that engine, which would hide the cause."""


def _register_after_import(patch: Patch) -> None:
    try:
        register_engines(patch, engine_classes(), DEVICES)
    except Exception as exc:
        raise RouteDriftRegistrationError(
            f"respo-verl could not register its route-drift Megatron engines (vendor {VENDOR}) after verl imported "
            f"{MEGATRON_ENGINE_MODULE}: {type(exc).__name__}: {exc}"
        ) from exc


def _install(patch: Patch) -> None:
    from respo_verl.patches.verl_0_9_1_routes import ROUTES_UINT8

    if ROUTES_UINT8.apply():  # the agent loops of every verl process, where R3's routes enter the TransferQueue
        patch.on_remove(ROUTES_UINT8.remove, where=ROUTES_UINT8.name, why="applied with the route-drift engines")
    patch.after_import(
        MEGATRON_ENGINE_MODULE,
        lambda: _register_after_import(patch),
        why="register the route-drift engines once verl has imported its Megatron engine",
    )


REGISTRATION = Patch("route-drift Megatron engines (vendor respo_route_drift)", "verl", "0.9.1", _install)


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
        self.update_index = 0  # j of the next training call in the step's update pass
        self.route_bytes: tuple[int, int] | None = None  # (bytes, samples) of the forward-only calls' routes

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.remove()
        self.module, self.monitor, self.pending = None, None, (None, None)

    def _attach(self, module) -> None:
        from respo_verl.routing.megatron import RouteDriftMonitor, find_replay_routers

        if module is self.module:
            return
        self.close()
        self.module = module
        # A pipeline stage may hold no MoE layer: no monitor, but it still takes part in the all_reduce.
        self.monitor = RouteDriftMonitor.attach(module) if find_replay_routers(module) else None
        if self.monitor is not None:
            self.monitor.index_checked_on_host = True  # run() checks every batch's routed_experts first

    def run(self, original, engine, data, loss_function, forward_only):
        """``original(data, loss_function, forward_only)`` (verl's bound method) with the routers watched."""
        from verl.utils import tensordict_utils as tu

        from respo_verl.routing.diagnostics import per_update_metrics

        self._attach(engine.module)
        routes = data.get("routed_experts", None)
        if routes is not None:
            from respo_verl.routing.megatron import check_expert_indices

            check_expert_indices(routes, engine.tf_config.num_moe_experts)
        if self.monitor is None:
            output = original(data, loss_function, forward_only)
            sums = (None, None)
        else:
            with self.monitor.step():
                output = original(data, loss_function, forward_only)
            sums = self.monitor.sums(reset=True)
        if forward_only:
            self.pending = (_add(self.pending[0], sums[0]), _add(self.pending[1], sums[1]))
            if routes is not None:  # R3: the rollout's routes, as the TransferQueue handed them to this rank
                values = routes.values() if routes.is_nested else routes
                done = self.route_bytes or (0, 0)
                self.route_bytes = (done[0] + values.numel() * values.element_size(), done[1] + routes.shape[0])
            self.update_index = 0  # a new rollout batch's old-log-prob pass: the next update is its first
            return output
        log_prob_sums, self.pending = self.pending, (None, None)
        update_index = self.update_index
        # verl's worker flags the last mini-batch of the update pass (it steps the learning-rate scheduler there).
        last = bool(tu.get_non_tensor_data(data, key="update_lr_scheduler", default=False))
        self.update_index = 0 if last else update_index + 1
        metrics = self._reduce(engine, {TRAIN_PREFIX: sums, LOG_PROB_PREFIX: log_prob_sums})
        metrics.update(per_update_metrics(metrics, update_index, prefix=TRAIN_PREFIX))
        if self.route_bytes is not None:
            device = self._device(engine, {})
            metrics.update(route_bytes_metrics(self.route_bytes, engine.get_data_parallel_group(), device))
            self.route_bytes = None
        if metrics and engine.is_mp_src_rank_with_outputs() and isinstance(output, dict) and "metrics" in output:
            # One-element lists, the shape of verl's per-micro-batch metrics (worker flattens, trainer averages).
            output["metrics"].update({key: [value] for key, value in metrics.items()})
        return output

    def _reduce(self, engine, sums_by_prefix: dict) -> dict[str, float]:
        from respo_verl.routing.megatron import reduce_route_drift

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


def route_bytes_metrics(local: tuple[int, int], group=None, device: torch.device | None = None) -> dict[str, float]:
    """``routing/route_bytes...`` of R3's routes the forward-only calls received, from this rank's (bytes, samples):
    summed over the data-parallel ``group`` (its ranks hold disjoint samples; the ranks of one data-parallel rank
    receive the same ones), the mean per sample and the most one rank received. One all_gather of two numbers."""
    import torch.distributed as dist

    mine = torch.tensor(local, dtype=torch.float64, device=device)  # on the accelerator for NCCL
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        mine = torch.stack(gathered)
    per_rank = mine.reshape(-1, 2)  # (ranks, 2)
    total, samples = per_rank.sum(dim=0).tolist()
    return {
        f"{LOG_PROB_PREFIX}/route_bytes": total,
        f"{LOG_PROB_PREFIX}/route_bytes_per_sample": total / max(samples, 1.0),
        f"{LOG_PROB_PREFIX}/route_bytes_max_rank": float(per_rank[:, 0].max()),
    }
