"""Route-drift diagnostics and replay-input checks on megatron-core's routing-replay seam.

While a replay is in force, every ``TopKRouter`` asks its ``router_replay`` object for the top-k:
``router_replay.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)``. Both megatron-core's
native :class:`megatron.core.transformer.moe.router_replay.RouterReplay` (``moe_enable_routing_replay``, core >= 0.16)
and verl 0.9.1's own ``RouterReplay`` (``verl.utils.megatron.router_replay_patch.apply_router_replay_patch``) use
this call with the same arguments and the same actions (RECORD / REPLAY_FORWARD / REPLAY_BACKWARD). The monitor
wraps that method on the ``router_replay`` object of each router of the model it is given (an instance attribute,
never the class, never a process-global list; one :class:`respo_verl.patches.Patch` per monitor, patches/README.md),
so it works with whichever implementation built the model.

On REPLAY_FORWARD the wrapper

- checks the replay data: present, shape (tokens, topk) equal to the scores' token count, indices in
  ``[0, num_experts)``; an error (ValueError) names the layer and the shapes, on CPU and CUDA alike. For data on an
  accelerator the index check costs one host sync per router and replayed forward. The route-drift engine checks
  the whole batch's ``routed_experts`` on the host once per call instead (:func:`check_expert_indices`) and
  switches the per-router index check off (``index_checked_on_host``);
- computes the native top-k once more from the ``scores`` the router passes in (one extra top-k; the logits and
  scores exist anyway) and accumulates :class:`respo_verl.routing.diagnostics.RouteDriftStats`. Counted are the
  replayed tokens: with verl's R3 ``replay_mask`` the tokens with rollout routes; and never verl's THD padding rows.
  verl packs each sequence to a multiple of TP·CP (·2 with CP) and replays the padding rows as expert 0 repeated k
  times, which no router can choose (a top-k holds k distinct experts), so with ``topk > 1`` such rows are not
  counted (with ``topk == 1`` a padding row cannot be told from a route to expert 0, and is counted).

REPLAY_BACKWARD (recompute of the same forward in the backward pass) is checked but not counted again.
:meth:`RouteDriftMonitor.step` closes a step: replay data set on a router (``set_target_indices``) and never
consumed by a REPLAY_FORWARD before the next set or the end of the step is an error. Nothing is installed when the
model has no ``router_replay`` objects (replay off): zero cost.

Layer keys are ``router.layer_number - 1``: megatron's global 1-based layer number, so pipeline stages report the
layers they hold under their global indices; ``any_layer_flip_frac`` covers the layers of one stage. With virtual
pipeline stages (a list of model chunks), forwards are tracked per chunk and micro-batch (see
:class:`respo_verl.routing.diagnostics.RouteDriftStats`), which is right in megatron's interleaved order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

import torch
from megatron.core.transformer.moe.router import TopKRouter
from torch import nn

from respo_verl.patches import Patch
from respo_verl.routing.diagnostics import RouteDriftStats, drift_metrics

_WRAPPED_ATTR = "_respo_route_drift_monitor"
# One Patch per monitor: the routers' replay objects of the one model it watches (an instance each, never the class).
MONITOR_PATCH_NAME = "route-drift monitor on the routers' replay objects"
_REPLAY_FORWARD, _REPLAY_BACKWARD = "REPLAY_FORWARD", "REPLAY_BACKWARD"


def _action_name(router_replay) -> str | None:
    action = getattr(router_replay, "router_replay_action", None)
    return None if action is None else action.name  # megatron's and verl's enums share member names


def find_replay_routers(model: nn.Module | Iterable[nn.Module]) -> dict[int, TopKRouter]:
    """``TopKRouter`` modules of ``model`` (or of its virtual-pipeline chunks) that carry a ``router_replay`` object,
    keyed by 0-based global layer index."""
    return {layer: router for layer, (router, _) in _replay_routers(model).items()}


def _replay_routers(model: nn.Module | Iterable[nn.Module]) -> dict[int, tuple[TopKRouter, int]]:
    """As :func:`find_replay_routers`, with the index of the chunk holding each router."""
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    routers: dict[int, tuple[TopKRouter, int]] = {}
    for chunk_index, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if not isinstance(module, TopKRouter) or getattr(module, "router_replay", None) is None:
                continue
            if module.layer_number is None:
                raise ValueError(f"router {name!r} has no layer_number; build the model through TransformerLayer")
            layer = module.layer_number - 1
            if layer in routers:
                raise ValueError(f"two routers claim MoE layer {layer} (router {name!r})")
            routers[layer] = (module, chunk_index)
    return routers


class RouteDriftMonitor:
    """Route-drift diagnostics (and replay-input checks) for one megatron-core model.

    Args:
        model: a ``GPTModel`` (possibly wrapped: DDP, Float16Module) or the list of its virtual-pipeline chunks,
            built with routing replay on (``moe_enable_routing_replay=True``, or verl's patch).

    Raises:
        ValueError: the model has no router with a ``router_replay`` object (routing replay is off).

    Use :meth:`attach` to get the monitor installed on a model (idempotent), :meth:`remove` or a ``with`` block to
    unhook it, :meth:`step` around one step's forwards, and :meth:`metrics` to read ``actor/routing/...`` scalars.

    Attributes:
        index_checked_on_host: set by a caller that has checked every expert index it replays on the host
            (:func:`check_expert_indices`, as the route-drift engine does): the routers then skip their own index
            check of replay data on an accelerator, which costs a host sync per router. False by default.
    """

    def __init__(self, model: nn.Module | Iterable[nn.Module]):
        with_chunks = _replay_routers(model)
        self.routers = {layer: router for layer, (router, _) in with_chunks.items()}
        if not self.routers:
            raise ValueError(
                "no MoE router with routing replay in the model: build it with moe_enable_routing_replay=True "
                "(megatron-core) or after verl's apply_router_replay_patch() with enable_routing_replay=True"
            )
        for layer, router in self.routers.items():
            owner = getattr(router.router_replay, _WRAPPED_ATTR, None)
            if owner is not None:
                raise RuntimeError(f"MoE layer {layer} already has a RouteDriftMonitor; use RouteDriftMonitor.attach")
        self.layers = tuple(sorted(self.routers))
        self.index_checked_on_host = False
        self._stats = RouteDriftStats(self.layers, {layer: chunk for layer, (_, chunk) in with_chunks.items()})
        self._pending: dict[int, tuple[int, ...]] = {}  # layer -> shape of replay data set and not consumed yet
        self._unconsumed: list[str] = []
        self._patch = Patch(MONITOR_PATCH_NAME, "megatron-core", "0.16.1", self._install)
        self._patch.apply()

    def _install(self, patch: Patch) -> None:
        for layer, router in self.routers.items():
            replay = router.router_replay
            checked = self._wrap(layer, router, replay.get_replay_topk)
            patch.replace(replay, "get_replay_topk", checked, "checks the replay data, counts the route drift")
            tracked = self._wrap_set(layer, replay.set_target_indices)
            patch.replace(replay, "set_target_indices", tracked, "replay data never consumed is an error")
            patch.replace(replay, _WRAPPED_ATTR, self, "the monitor whose wrappers these are")

    @classmethod
    def attach(cls, model: nn.Module | Iterable[nn.Module]) -> RouteDriftMonitor:
        """The monitor installed on ``model``'s routers, installing one if there is none."""
        routers = find_replay_routers(model)
        owners = {id(getattr(r.router_replay, _WRAPPED_ATTR, None)) for r in routers.values()}
        if len(owners) == 1 and routers:
            owner = getattr(next(iter(routers.values())).router_replay, _WRAPPED_ATTR, None)
            if owner is not None:
                return owner
        return cls(model)

    @property
    def installed(self) -> bool:
        return any(getattr(r.router_replay, _WRAPPED_ATTR, None) is self for r in self.routers.values())

    def remove(self) -> None:
        """Unhook every router (idempotent): the ``router_replay`` objects get their class method back."""
        self._patch.remove()

    def __enter__(self) -> RouteDriftMonitor:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One step (e.g. verl's ``forward_backward_batch``): on a clean exit, replay data that some layer was given
        but never consumed by a REPLAY_FORWARD raises, naming the layer and the data's shape. verl clears the
        routers' data at the end of its method, so what was set is tracked as it is set."""
        try:
            yield
        finally:
            self._stats.end_forward()
        unconsumed = self._unconsumed + [f"layer {layer} {shape}" for layer, shape in sorted(self._pending.items())]
        self._pending, self._unconsumed = {}, []
        if unconsumed:
            raise ValueError(
                f"routing replay: replay data left unconsumed at the end of the step: {', '.join(unconsumed)}"
            )

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Route drift since the last reset; the key set is fixed by the model's layers (one host sync)."""
        return self._stats.metrics(reset=reset)

    def sums(self, reset: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The device-side sums behind :meth:`metrics` (rows in :attr:`layers` order), for reducing across ranks;
        see :meth:`respo_verl.routing.diagnostics.RouteDriftStats.sums`."""
        return self._stats.sums(reset=reset)

    # -- internals --------------------------------------------------------------------------------------------

    def _wrap(self, layer: int, router: TopKRouter, get_replay_topk):
        replay = router.router_replay
        num_experts = router.config.num_moe_experts
        pre_softmax = router.config.moe_router_pre_softmax
        softmax_scores = router.score_function == "softmax"

        def checked_get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            action = _action_name(replay)
            if action == _REPLAY_FORWARD:
                target = replay.target_topk_idx
                self._check(layer, target, scores, topk, num_experts, "REPLAY_FORWARD", self.index_checked_on_host)
            elif action == _REPLAY_BACKWARD:
                pending = getattr(replay, "replay_backward_list", None)
                if not pending:
                    raise ValueError(
                        f"routing replay: layer {layer}: REPLAY_BACKWARD (recompute) with no replay data left; "
                        f"scores {tuple(scores.shape)}"
                    )
                self._check(layer, pending[0], scores, topk, num_experts, "REPLAY_BACKWARD", self.index_checked_on_host)
            probs, topk_idx = get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            if action == _REPLAY_FORWARD:
                self._pending.pop(layer, None)
                with torch.no_grad():
                    _, native_topk_idx = default_compute_topk(
                        scores, topk, num_groups=num_groups, group_topk=group_topk
                    )
                    full_probs = None
                    if softmax_scores:
                        # scores are probabilities with moe_router_pre_softmax, logits otherwise.
                        full_probs = scores if pre_softmax else torch.softmax(scores, dim=-1, dtype=torch.float32)
                    # verl's R3 replays only tokens with rollout routes (replay_mask); the rest route natively
                    # and are not counted.
                    replay_mask = getattr(replay, "target_replay_mask", None)
                    token_mask = None if replay_mask is None else replay_mask.to(scores.device).reshape(-1).bool()
                    padding = padding_rows(topk_idx)
                    if padding is not None:
                        token_mask = ~padding if token_mask is None else token_mask & ~padding
                    self._stats.update(layer, topk_idx, native_topk_idx, full_probs, token_mask)
            return probs, topk_idx

        return checked_get_replay_topk

    def _wrap_set(self, layer: int, set_target_indices):
        def tracked_set_target_indices(topk_indices, *args, **kwargs):
            if layer in self._pending:
                self._unconsumed.append(f"layer {layer} {self._pending[layer]} (replaced before use)")
            self._pending[layer] = tuple(topk_indices.shape)
            return set_target_indices(topk_indices, *args, **kwargs)

        return tracked_set_target_indices

    @staticmethod
    def _check(
        layer: int, target, scores: torch.Tensor, topk: int, num_experts: int, action: str, indices_checked: bool
    ) -> None:
        if target is None:
            raise ValueError(
                f"routing replay: layer {layer}: {action} but no replay data was set for this layer "
                f"(scores {tuple(scores.shape)}, expected routes ({scores.shape[0]}, {topk}))"
            )
        if target.shape != (scores.shape[0], topk):
            raise ValueError(
                f"routing replay: layer {layer}: replay data of shape {tuple(target.shape)}, but the router routes "
                f"{scores.shape[0]} tokens with topk={topk}: expected ({scores.shape[0]}, {topk})"
            )
        if target.is_floating_point():
            raise ValueError(f"routing replay: layer {layer}: replay data must be integer, got {target.dtype}")
        if indices_checked and target.device.type != "cpu":
            return  # checked on the host before the forward; a check here would cost a host sync per router
        if not bool(((target >= 0) & (target < num_experts)).all()):
            raise ValueError(
                f"routing replay: layer {layer}: replay data of shape {tuple(target.shape)} holds an expert index "
                f"outside [0, {num_experts})"
            )


def padding_rows(topk_idx: torch.Tensor) -> torch.Tensor | None:
    """(tokens,) bool, the rows of replayed routes that are verl's THD padding: expert 0 repeated ``topk`` times
    (a router's top-k holds distinct experts). None when ``topk == 1``, where padding cannot be told apart."""
    if topk_idx.shape[-1] < 2:
        return None
    return (topk_idx == 0).all(dim=-1)


def check_expert_indices(routes: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError naming the layers if ``routes`` (verl's ``routed_experts``: (batch, tokens, layers, topk),
    dense or nested) hold an expert index outside ``[0, num_experts)``. One reduction and one host copy."""
    values = routes.values() if routes.is_nested else routes
    if values.numel() == 0:
        return
    if values.is_floating_point():
        raise ValueError(f"routing replay: routed_experts must be integer, got {values.dtype}")
    flat = values.reshape(-1, *values.shape[-2:])  # (rows, layers, topk)
    bad = ((flat < 0) | (flat >= num_experts)).any(dim=-1).any(dim=0)  # (layers,)
    layers = torch.nonzero(bad).flatten().tolist()  # the one host copy
    if layers:
        lo, hi = values.min().item(), values.max().item()
        raise ValueError(
            f"routing replay: routed_experts (shape {tuple(values.shape)}) hold expert indices outside "
            f"[0, {num_experts}) in layer(s) {layers} of their layer dimension (min {lo}, max {hi})"
        )


def reduce_route_drift(
    local_layers: Sequence[int],
    sums_by_prefix: Mapping[str, tuple[torch.Tensor | None, torch.Tensor | None]],
    device: torch.device,
    sequence_parallel: bool,
    optional_prefixes: Collection[str] = (),
) -> dict[str, float]:
    """Route-drift metrics of the whole model: per-layer and per-stage sums added over every rank of the world.

    Every rank of the (gloo or NCCL) world must call it with the same prefixes. Per-layer sums are added over ranks
    before the ratios are formed, so per-layer and overall ratios are exact token averages over DP, CP, TP and
    pipeline stages. ``replayed_tokens`` is de-duplicated over TP ranks when sequence parallelism is off (every TP
    rank then routes the same tokens). ``any_layer_flip_frac`` needs a per-token OR over all layers; pipeline stages
    never see each other's tokens, so with PP > 1 it is reported per stage as ``any_layer_flip_frac/pp_stage_{s}``.

    Args:
        local_layers: global indices of this rank's MoE layers (rows of its per-layer sums), empty for none.
        sums_by_prefix: metric prefix -> ``(per_layer, any_layer)`` sums of
            :meth:`RouteDriftMonitor.sums` on this rank (None where nothing was counted).
        device: where the reduction buffer lives (the communication backend's device).
        sequence_parallel: whether TP ranks split the tokens (megatron's ``sequence_parallel``).
        optional_prefixes: prefixes left out of the result when no rank counted a token for them.

    Returns:
        The metrics of :func:`respo_verl.routing.diagnostics.drift_metrics` per prefix; empty when no rank holds a
        MoE layer. One host synchronisation.
    """
    from megatron.core import parallel_state as mpu

    dist = torch.distributed
    # The width of the sums comes from the ranks that counted something, so that it is defined in one place
    # (RouteDriftStats) and a rank without counts still contributes a block of the same shape.
    slots = max((per_layer.shape[-1] for per_layer, _ in sums_by_prefix.values() if per_layer is not None), default=0)
    header = torch.tensor([max(local_layers, default=-1) + 1, slots], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(header, op=dist.ReduceOp.MAX)
    num_layers, slots = (int(v) for v in header.tolist())
    if num_layers == 0:
        return {}
    width = 1 + slots  # per layer: present on this rank, then the sums
    pp_size, pp_rank = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    rows = torch.tensor(list(local_layers), dtype=torch.long, device=device)
    blocks = []
    for per_layer, any_layer in sums_by_prefix.values():
        layer_block = torch.zeros(num_layers, width, dtype=torch.float64, device=device)
        layer_block[rows, 0] = 1.0
        if per_layer is not None:
            layer_block[rows, 1:] = per_layer.to(device=device, dtype=torch.float64)
        stage_block = torch.zeros(pp_size, 2, dtype=torch.float64, device=device)
        if any_layer is not None:
            stage_block[pp_rank] = any_layer.to(device=device, dtype=torch.float64)
        blocks += [layer_block.reshape(-1), stage_block.reshape(-1)]
    flat = torch.cat(blocks)
    if dist.is_initialized():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    tp_copies = 1 if sequence_parallel else mpu.get_tensor_model_parallel_world_size()
    flat = flat.cpu()  # the one host sync
    metrics: dict[str, float] = {}
    offset = 0
    for prefix in sums_by_prefix:
        layer_block = flat[offset : offset + num_layers * width].reshape(num_layers, width)
        offset += num_layers * width
        stage_block = flat[offset : offset + pp_size * 2].reshape(pp_size, 2)
        offset += pp_size * 2
        layers = torch.nonzero(layer_block[:, 0] > 0).flatten()
        counted = stage_block[:, 0].max()
        if prefix in optional_prefixes and counted == 0:
            continue
        any_layer = torch.stack([counted, stage_block[:, 1].sum() if pp_size == 1 else counted.new_zeros(())])
        per_layer = layer_block[layers, 1:] if slots else None
        values = drift_metrics(layers.tolist(), per_layer, any_layer if slots else None, prefix=prefix)
        values[f"{prefix}/replayed_tokens"] = counted.item() / tp_copies
        if pp_size > 1:
            del values[f"{prefix}/any_layer_flip_frac"]
            for stage in range(pp_size):
                values[f"{prefix}/any_layer_flip_frac/pp_stage_{stage}"] = (
                    stage_block[stage, 1] / stage_block[stage, 0]
                ).item()
        metrics.update(values)
    return metrics
