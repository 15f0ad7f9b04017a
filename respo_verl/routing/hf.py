"""Routing replay for HF/transformers Qwen3-MoE models (the path verl's FSDP engine uses; verl has none there).

R2 / R3 (``docs/routing-replay.md``; GSPO arXiv 2507.18071, R3 arXiv 2510.11370): record the top-k experts a
forward chose, and force them in a later forward. Replay fixes the discrete selection only: the gate weights are the
live router's softmax restricted to the recorded experts and renormalised exactly as the model does
(``norm_topk_prob``), so the router keeps its gradient.

Usage in a plain PyTorch loop::

    replay = RoutingReplay(model)                 # walks model's modules, hooks every Qwen3MoeTopKRouter
    with torch.no_grad(), replay.record() as routes:
        old_logits = model(input_ids).logits      # routes: {layer: LongTensor(tokens, k)}, filled by the forward
    with replay.replay(routes):
        loss = loss_fn(model(input_ids).logits)   # experts forced, gate weights live
        loss.backward()                           # inside the context if gradient checkpointing recomputes
    metrics = replay.diagnostics()                # {"actor/routing/...": float}, same keys every call
    replay.remove()                               # or use RoutingReplay(model) as a context manager

Routes may be given as (tokens, k) or (batch, seq, k) per layer, in any integer dtype (uint8 fits 128 experts);
tokens are the flattened (batch * seq) positions the router sees. Everything is explicit state on the
:class:`RoutingReplay` object: no environment variables, no process-global list of routers.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from respo_verl.routing.diagnostics import RouteDriftStats

_ATTACHED_ATTR = "_respo_routing_replay"
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_OFF, _RECORD, _REPLAY = "off", "record", "replay"


def _default_router_types() -> tuple[type[nn.Module], ...]:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return (Qwen3MoeTopKRouter,)


def find_routers(model: nn.Module, router_types: tuple[type[nn.Module], ...] | None = None) -> dict[int, nn.Module]:
    """Top-k routers of ``model`` keyed by decoder-layer index (from the ``layers.<i>`` in the module name).

    Raises:
        ValueError: no router found, or two routers claim the same layer index.
    """
    router_types = router_types or _default_router_types()
    routers: dict[int, nn.Module] = {}
    names: dict[int, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, router_types):
            continue
        match = _LAYER_INDEX.findall(name)
        layer = int(match[-1]) if match else len(routers)
        if layer in routers:
            raise ValueError(f"routers {names[layer]!r} and {name!r} both map to MoE layer {layer}")
        routers[layer], names[layer] = module, name
    if not routers:
        wanted = ", ".join(t.__name__ for t in router_types)
        raise ValueError(f"no MoE router ({wanted}) found in {type(model).__name__}")
    return routers


class RoutingReplay:
    """Record / replay the top-k expert choice of every MoE layer of one HF model.

    Args:
        model: the model to hook (e.g. ``Qwen3MoeForCausalLM``); its routers are found by walking its modules.
        diagnostics: compare replayed with native routes while replaying (one extra gather per layer; the native
            top-k is computed by the router anyway). Read with :meth:`diagnostics`.
        router_types: router classes to hook; default ``(Qwen3MoeTopKRouter,)``. A router must have ``top_k``,
            ``num_experts``, ``norm_topk_prob`` and return ``(router_logits, routing_weights, topk_idx)``.

    Constructing a second ``RoutingReplay`` for a model that already has one raises; use :meth:`attach` to get the
    installed one (idempotent). :meth:`remove` (or leaving ``with RoutingReplay(model):``) unhooks the model.
    """

    def __init__(
        self, model: nn.Module, diagnostics: bool = True, router_types: tuple[type[nn.Module], ...] | None = None
    ):
        existing = getattr(model, _ATTACHED_ATTR, None)
        if existing is not None:
            raise RuntimeError(
                f"{type(model).__name__} already has a RoutingReplay installed; use RoutingReplay.attach(model)"
            )
        self.model = model
        self.routers = find_routers(model, router_types)
        self.layers = tuple(sorted(self.routers))
        self.collect_diagnostics = diagnostics
        self._stats = RouteDriftStats(self.layers)
        self._mode = _OFF
        self._routes: dict[int, torch.Tensor] = {}
        self._used: set[int] = set()
        self._token_mask: torch.Tensor | None = None
        self._handles = [router.register_forward_hook(self._make_hook(layer)) for layer, router in self.routers.items()]
        object.__setattr__(model, _ATTACHED_ATTR, self)

    @classmethod
    def attach(cls, model: nn.Module, **kwargs) -> RoutingReplay:
        """The RoutingReplay installed on ``model``, installing one if there is none."""
        existing = getattr(model, _ATTACHED_ATTR, None)
        return existing if existing is not None else cls(model, **kwargs)

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        """Unhook the model (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if getattr(self.model, _ATTACHED_ATTR, None) is self:
            object.__delattr__(self.model, _ATTACHED_ATTR)

    def __enter__(self) -> RoutingReplay:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    @contextlib.contextmanager
    def record(self) -> Iterator[dict[int, torch.Tensor]]:
        """Record the native top-k of the forward run inside the context.

        Yields:
            A dict that the forward fills: ``{layer: topk_idx}``, ``topk_idx`` (tokens, k) int64, detached.
        """
        self._enter(_RECORD)
        routes: dict[int, torch.Tensor] = {}
        self._routes = routes
        try:
            yield routes
        finally:
            self._reset_mode()

    @contextlib.contextmanager
    def replay(self, routes: Mapping[int, torch.Tensor], token_mask: torch.Tensor | None = None) -> Iterator[None]:
        """Force ``routes`` in the forward (and any recompute) run inside the context.

        Args:
            routes: ``{layer: topk_idx}`` for every MoE layer, ``topk_idx`` (tokens, k) or (batch, seq, k), integer.
            token_mask: (tokens,) or (batch, seq) bool: tokens counted by the diagnostics (e.g. the attention mask);
                replay itself applies to every token.

        Raises:
            ValueError: a layer is missing or unknown, a wrong shape, an index outside ``[0, num_experts)`` or a
                repeated expert in one token's route (at entry or at the layer's router), or a layer's routes were
                never used by the end of the context.
        """
        self._enter(_REPLAY)
        self._routes = self._validate(routes)
        self._token_mask = None if token_mask is None else token_mask.reshape(-1).bool()
        completed = False
        try:
            yield
            completed = True
        finally:
            unused = [layer for layer in self.layers if layer not in self._used]
            if self.collect_diagnostics:
                self._stats.end_forward()
            self._reset_mode()
        if completed and unused:
            detail = ", ".join(f"layer {layer} {tuple(routes[layer].shape)}" for layer in unused)
            raise ValueError(f"routing replay: routes left unconsumed at the end of the step: {detail}")

    def diagnostics(self, reset: bool = True) -> dict[str, float]:
        """Route-drift metrics (see :mod:`respo_verl.routing.diagnostics`) over the replays since the last reset."""
        return self._stats.metrics(reset=reset)

    # -- internals --------------------------------------------------------------------------------------------

    def _enter(self, mode: str) -> None:
        if not self._handles:
            raise RuntimeError("RoutingReplay was removed from the model; construct a new one")
        if self._mode != _OFF:
            raise RuntimeError(f"routing replay: cannot start {mode}() inside an active {self._mode}()")
        self._mode = mode
        self._used = set()

    def _reset_mode(self) -> None:
        self._mode = _OFF
        self._routes = {}
        self._used = set()
        self._token_mask = None

    def _validate(self, routes: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        unknown = sorted(set(routes) - set(self.layers))
        missing = sorted(set(self.layers) - set(routes))
        if unknown or missing:
            raise ValueError(
                f"routing replay: routes must cover exactly the MoE layers {list(self.layers)}; "
                f"missing {missing}, unknown {unknown}"
            )
        checked: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            router, topk_idx = self.routers[layer], routes[layer]
            if not isinstance(topk_idx, torch.Tensor) or topk_idx.is_floating_point() or topk_idx.is_complex():
                raise ValueError(f"routing replay: layer {layer}: routes must be an integer tensor, got {topk_idx!r}")
            if topk_idx.dim() < 2 or topk_idx.shape[-1] != router.top_k:
                raise ValueError(
                    f"routing replay: layer {layer}: routes of shape {tuple(topk_idx.shape)}, expected (tokens, "
                    f"{router.top_k}) or (batch, seq, {router.top_k})"
                )
            checked[layer] = topk_idx.reshape(-1, router.top_k).long()  # (tokens, k)
        # One host sync for all layers: per layer min, max and whether any token repeats an expert.
        summary = torch.stack(
            [
                torch.stack(
                    [
                        idx.min() if idx.numel() else idx.new_zeros(()),
                        idx.max() if idx.numel() else idx.new_zeros(()),
                        (idx.sort(dim=-1).values.diff(dim=-1) == 0).any().long(),
                    ]
                ).to("cpu", non_blocking=False)
                for idx in checked.values()
            ]
        ).tolist()
        for layer, (low, high, repeated) in zip(self.layers, summary, strict=True):
            num_experts = self.routers[layer].num_experts
            if low < 0 or high >= num_experts:
                raise ValueError(
                    f"routing replay: layer {layer}: routes of shape {tuple(routes[layer].shape)} hold expert "
                    f"indices in [{low}, {high}], outside [0, {num_experts}) (num_experts={num_experts})"
                )
            if repeated:
                raise ValueError(
                    f"routing replay: layer {layer}: routes of shape {tuple(routes[layer].shape)} repeat an expert "
                    f"within one token's top-{self.routers[layer].top_k}"
                )
        return checked

    def _make_hook(self, layer: int):
        def hook(router: nn.Module, args, output):
            if self._mode == _RECORD:
                self._record(layer, output)
                return None
            if self._mode == _REPLAY:
                return self._replay(layer, router, output)
            return None

        return hook

    def _record(self, layer: int, output) -> None:
        _, _, topk_idx = output
        topk_idx = topk_idx.detach()  # (tokens, k)
        previous = self._routes.get(layer)
        if previous is None:
            self._routes[layer] = topk_idx.clone()
        elif previous.shape != topk_idx.shape or not torch.equal(previous, topk_idx):
            # A recompute (gradient checkpointing) must reproduce the routes; two different forwards need two
            # record() contexts.
            raise ValueError(
                f"routing record: layer {layer} routed twice in one record() context with different routes "
                f"({tuple(previous.shape)} vs {tuple(topk_idx.shape)}); use one record() per forward"
            )

    def _replay(self, layer: int, router: nn.Module, output):
        router_logits, _, native_topk_idx = output  # (tokens, num_experts), _, (tokens, k)
        topk_idx = self._routes[layer]
        if topk_idx.shape != native_topk_idx.shape:
            raise ValueError(
                f"routing replay: layer {layer}: routes of shape {tuple(topk_idx.shape)} (tokens, k) but the router "
                f"sees {native_topk_idx.shape[0]} tokens with top_k={router.top_k}: expected "
                f"{tuple(native_topk_idx.shape)}"
            )
        topk_idx = topk_idx.to(native_topk_idx.device)
        # The router's own arithmetic: float32 softmax over all experts, top-k values renormalised, cast back.
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)  # (tokens, num_experts)
        topk_probs = probs.gather(-1, topk_idx)  # (tokens, k)
        if router.norm_topk_prob:
            topk_probs = topk_probs / topk_probs.sum(dim=-1, keepdim=True)
        routing_weights = topk_probs.to(router_logits.dtype)
        if self.collect_diagnostics and layer not in self._used:
            mask = self._token_mask
            if mask is not None and mask.shape[0] != topk_idx.shape[0]:
                raise ValueError(
                    f"routing replay: token_mask has {mask.shape[0]} tokens, layer {layer} routes {topk_idx.shape[0]}"
                )
            self._stats.update(
                layer, topk_idx, native_topk_idx, probs.detach(), None if mask is None else mask.to(probs.device)
            )
        self._used.add(layer)
        return router_logits, routing_weights, topk_idx
