"""Route-drift diagnostics: how far replayed MoE routes are from the routes the live router would choose.

Torch only. Shared by the HF replay (:mod:`respo_verl.routing.hf`) and the Megatron hooks
(:mod:`respo_verl.routing.megatron`), so both report the same ``actor/routing/...`` metrics.

Per MoE layer ``l`` and token ``t``, with ``R`` the replayed expert set and ``N`` the native one (the live router's
own top-k of its scores), both of size ``k``:

- ``flip_frac/layer_l``: fraction of tokens with ``R != N`` (as sets; order within the top-k is ignored);
- ``overlap/layer_l``: mean of ``|R ∩ N| / k``;
- ``prob_mass_delta/layer_l``: mean of ``sum_{e in R} p_e - sum_{e in N} p_e`` with ``p`` the live router's full
  softmax probabilities (before top-k normalisation); never positive, 0 when nothing flipped;
- ``any_layer_flip_frac``: fraction of tokens with ``R != N`` in at least one layer of the same forward;
- ``flip_frac``, ``overlap``, ``prob_mass_delta``: the same, averaged over all (layer, token) pairs;
- ``replayed_tokens``: tokens counted (per forward, not per layer).

Sums stay on the device until :meth:`RouteDriftStats.metrics`, which makes one host copy for all layers.

By update index. Reusing a rollout batch for N updates makes the j-th update's replayed routes j updates stale (R2).
:func:`per_update_metrics` files one update's whole-model metrics (every key above but the per-layer ones) again
under ``by_update/j<j>/...`` (:func:`update_label`), so a step's log keeps the drift of each j, not only the mean.
Updates from :data:`EXACT_UPDATES` on share power-of-two buckets (``j64-127``, ``j128-255``, ...).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import torch

METRIC_PREFIX = "actor/routing"
PER_LAYER_METRICS = ("flip_frac", "overlap", "prob_mass_delta")
# Update indices below this get a key each: twice the largest N of the ReSPO paper (32), so its whole regime is
# logged per j; later indices share power-of-two buckets, which bounds the keys at any N.
EXACT_UPDATES = 64
BY_UPDATE = "by_update"
_WHOLE_MODEL_METRICS = (*PER_LAYER_METRICS, "any_layer_flip_frac", "replayed_tokens")
_STAGE_KEY = re.compile(r"^any_layer_flip_frac/pp_stage_\d+$")  # any_layer_flip_frac per stage with PP > 1
_UPDATE_LABEL = re.compile(r"^j(?P<lo>\d+)(?:-(?P<hi>\d+))?$")
# Sum slots kept per layer: tokens, flipped tokens, overlap / k, replayed-minus-native probability mass.
_TOKENS, _FLIPPED, _OVERLAP, _MASS_DELTA = range(4)
_NUM_SLOTS = 4


def route_drift(
    replayed_topk_idx: torch.Tensor, native_topk_idx: torch.Tensor, probs: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token drift between two top-k expert selections of the same tokens.

    Args:
        replayed_topk_idx: (tokens, k) expert indices forced by the replay.
        native_topk_idx: (tokens, k) expert indices the live router chose.
        probs: (tokens, num_experts) live routing probabilities (softmax of the router logits), or None to skip
            the probability mass.

    Returns:
        ``flipped_tok`` (tokens,) bool, expert sets differ; ``overlap_tok`` (tokens,) float, ``|R ∩ N| / k``;
        ``mass_delta_tok`` (tokens,) float, replayed minus native probability mass (None without ``probs``).
    """
    k = replayed_topk_idx.shape[-1]
    # k x k comparison instead of a (tokens, num_experts) mask: k = 8 against 128 experts for Qwen3-30B-A3B.
    member = (replayed_topk_idx.unsqueeze(-1) == native_topk_idx.unsqueeze(-2)).any(dim=-1)  # (tokens, k)
    hits = member.sum(dim=-1)  # (tokens,)
    flipped_tok = hits < k  # (tokens,)  routes hold k distinct experts, so k hits means equal sets
    overlap_tok = hits.to(torch.float32) / k  # (tokens,)
    mass_delta_tok = None
    if probs is not None:
        probs = probs.to(torch.float32)
        mass_delta_tok = probs.gather(-1, replayed_topk_idx).sum(-1) - probs.gather(-1, native_topk_idx).sum(-1)
    return flipped_tok, overlap_tok, mass_delta_tok


class RouteDriftStats:
    """Accumulates route drift over forwards until :meth:`metrics` is read.

    Args:
        layers: the MoE layer indices of the model (keys of the per-layer metrics). The metric key set depends only
            on these, so it is the same on every call, with NaN where nothing was replayed.
        chunk_of: layer -> model chunk (virtual-pipeline stage) holding it; None: one chunk holds every layer.

    Forwards for ``any_layer_flip_frac``: within one chunk, the layers of a micro-batch run in order, so a layer seen
    again starts the chunk's next micro-batch. Each chunk takes the micro-batches in the same order (megatron's
    interleaved schedule runs chunk 1 of micro-batch 0 after chunk 0 of micro-batch 1, but every chunk counts
    micro-batches 0, 1, 2, ...), so the n-th micro-batch of every chunk is the same tokens: their flips are OR-ed,
    and the micro-batch is closed once every chunk has moved past it.
    """

    def __init__(self, layers: Iterable[int], chunk_of: Mapping[int, int] | None = None):
        self.layers = tuple(sorted(layers))
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        chunk_of = dict(chunk_of) if chunk_of is not None else dict.fromkeys(self.layers, 0)
        if set(chunk_of) != set(self.layers):
            raise ValueError(f"chunk_of covers layers {sorted(chunk_of)}, not the MoE layers {list(self.layers)}")
        self._chunk_of = chunk_of
        self._chunks = tuple(sorted(set(chunk_of.values())))
        self._sums: torch.Tensor | None = None  # (layers, slots), lazily on the routes' device
        self._any_flipped: torch.Tensor | None = None  # (2,) tokens, tokens flipped in any layer
        self._reset_forwards()

    def _reset_forwards(self) -> None:
        self._chunk_layers: dict[int, set[int]] = {c: set() for c in self._chunks}  # layers of its micro-batch
        self._chunk_micro_batch: dict[int, int] = dict.fromkeys(self._chunks, -1)  # -1: none started
        # micro-batch -> (flipped_tok, weight_tok, first layer that counted it) of forwards still open
        self._open: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def update(
        self,
        layer: int,
        replayed_topk_idx: torch.Tensor,
        native_topk_idx: torch.Tensor,
        probs: torch.Tensor | None,
        token_mask: torch.Tensor | None = None,
    ) -> None:
        """Add one layer of one forward; see :func:`route_drift` for the arguments.

        Args:
            token_mask: (tokens,) bool, tokens to count (e.g. not padding); None counts all.
        """
        chunk = self._chunk_of[layer]
        if layer in self._chunk_layers[chunk] or self._chunk_micro_batch[chunk] < 0:
            self._chunk_layers[chunk] = set()
            self._chunk_micro_batch[chunk] += 1
        self._chunk_layers[chunk].add(layer)
        micro_batch = self._chunk_micro_batch[chunk]
        with torch.no_grad():
            flipped_tok, overlap_tok, mass_delta_tok = route_drift(replayed_topk_idx, native_topk_idx, probs)
            weight_tok = torch.ones_like(overlap_tok) if token_mask is None else token_mask.to(overlap_tok.dtype)
            if mass_delta_tok is None:
                mass_delta_tok = torch.full_like(overlap_tok, math.nan)
            row = torch.stack(
                [
                    weight_tok.sum(),
                    (flipped_tok * weight_tok).sum(),
                    (overlap_tok * weight_tok).sum(),
                    (mass_delta_tok * weight_tok).sum(),
                ]
            )  # (slots,)
            if self._sums is None:
                self._sums = torch.zeros(len(self.layers), _NUM_SLOTS, dtype=torch.float64, device=row.device)
                self._any_flipped = torch.zeros(2, dtype=torch.float64, device=row.device)
            self._sums[self._row[layer]] += row.to(torch.float64)
            flipped_tok = flipped_tok & (weight_tok > 0)
            if micro_batch not in self._open:
                self._open[micro_batch] = (flipped_tok, weight_tok, layer)
            else:
                so_far, weight, first = self._open[micro_batch]
                if so_far.shape != flipped_tok.shape:
                    raise ValueError(
                        f"routing diagnostics: MoE layer {layer} routed {flipped_tok.shape[0]} tokens in micro-batch "
                        f"{micro_batch}, but layer {first} routed {so_far.shape[0]} in the same micro-batch"
                    )
                self._open[micro_batch] = (so_far | flipped_tok, weight, first)
        self._close(min(self._chunk_micro_batch.values()))

    def _close(self, before: int) -> None:
        """Count the open micro-batches numbered below ``before``: their tokens flipped in at least one layer."""
        for micro_batch in sorted(m for m in self._open if m < before):
            flipped_tok, weight_tok, _ = self._open.pop(micro_batch)
            with torch.no_grad():
                self._any_flipped += torch.stack([weight_tok.sum(), flipped_tok.sum()]).to(torch.float64)

    def end_forward(self) -> None:
        """Close every forward in progress (the end of a step: every micro-batch has run through every chunk)."""
        self._close(math.inf)
        self._reset_forwards()

    def reset(self) -> None:
        self._sums = None
        self._any_flipped = None
        self._reset_forwards()

    def sums(self, reset: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The raw sums behind :meth:`metrics`, still on the device (no host sync), for reducing across ranks.

        Returns:
            ``(per_layer, any_layer)``: ``per_layer`` (layers, 4) float64, per row of :attr:`layers` the counted
            tokens, flipped tokens, summed overlap and summed probability-mass delta; ``any_layer`` (2,) float64,
            tokens counted per forward and tokens flipped in at least one layer. Both None if nothing was counted.
            :func:`drift_metrics` turns them into metrics.
        """
        self.end_forward()
        out = (self._sums, self._any_flipped)
        if reset:
            self.reset()
        return out

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """``actor/routing/...`` scalars since the last reset (NaN where no token was replayed)."""
        per_layer, any_layer = self.sums(reset=reset)
        return drift_metrics(self.layers, per_layer, any_layer)


def drift_metrics(
    layers: Iterable[int],
    per_layer: torch.Tensor | None,
    any_layer: torch.Tensor | None,
    prefix: str = METRIC_PREFIX,
) -> dict[str, float]:
    """Metrics from the sums of :meth:`RouteDriftStats.sums` (possibly summed over ranks first).

    Args:
        layers: the layer indices of the rows of ``per_layer``, in row order.
        per_layer: (layers, 4) sums, or None if nothing was counted.
        any_layer: (2,) sums, or None if nothing was counted.
        prefix: key prefix (``actor/routing``; verl's trainer adds ``actor/`` itself, so its engine uses
            ``routing``).

    Returns:
        The metrics listed in the module docstring, one host sync; NaN where no token was counted.
    """
    layers = tuple(layers)
    keys = [f"{prefix}/{name}/layer_{layer}" for name in PER_LAYER_METRICS for layer in layers]
    keys += [f"{prefix}/{name}" for name in PER_LAYER_METRICS]
    keys += [f"{prefix}/any_layer_flip_frac", f"{prefix}/replayed_tokens"]
    if per_layer is None or any_layer is None:
        return dict(zip(keys, [math.nan] * (len(keys) - 1) + [0.0], strict=True))
    tokens = per_layer[:, _TOKENS]
    ratios = per_layer[:, [_FLIPPED, _OVERLAP, _MASS_DELTA]] / tokens.unsqueeze(-1)  # (layers, 3), NaN at 0/0
    total = per_layer.sum(dim=0)
    overall = total[[_FLIPPED, _OVERLAP, _MASS_DELTA]] / total[_TOKENS]  # (3,)
    tail = torch.stack([any_layer[1] / any_layer[0], any_layer[0]])
    values = torch.cat([ratios.T.reshape(-1), overall, tail]).tolist()  # the one host sync
    return dict(zip(keys, values, strict=True))


def update_label(j: int) -> str:
    """The ``by_update`` label of update index ``j`` (0 = the first update on a rollout batch): ``j<j>`` below
    :data:`EXACT_UPDATES`, else the power-of-two bucket holding it, ``j<lo>-<hi>``."""
    if j < 0:
        raise ValueError(f"update index {j}: must be >= 0")
    if j < EXACT_UPDATES:
        return f"j{j}"
    lo = 1 << (j.bit_length() - 1)
    return f"j{lo}-{2 * lo - 1}"


def parse_update_label(label: str) -> tuple[int, int] | None:
    """``(lo, hi)``, the update indices a :func:`update_label` label covers (``j3``: (3, 3)); None for another text."""
    match = _UPDATE_LABEL.match(label)
    if match is None:
        return None
    lo = int(match["lo"])
    return lo, int(match["hi"]) if match["hi"] is not None else lo


def per_update_metrics(metrics: Mapping[str, float], j: int, prefix: str = METRIC_PREFIX) -> dict[str, float]:
    """One update's whole-model metrics under ``{prefix}/by_update/{update_label(j)}/...``.

    Args:
        metrics: the update's metrics (:func:`drift_metrics` or the cross-rank reduction), keys under ``prefix``.
        j: the update's index on its rollout batch (0 = first, routes freshly recorded under R2).
        prefix: the prefix of ``metrics``' keys; other prefixes (e.g. ``.../compute_log_prob``) are left out.

    Returns:
        The overall ratios, ``any_layer_flip_frac`` (per pipeline stage where so reported) and ``replayed_tokens``;
        per-layer keys are left out (layers × updates would be thousands of keys on a 48-layer model). No tensor is
        touched: the values are the floats already read.
    """
    label = update_label(j)
    out = {}
    for key, value in metrics.items():
        if not key.startswith(prefix + "/"):
            continue
        name = key[len(prefix) + 1 :]
        if name in _WHOLE_MODEL_METRICS or _STAGE_KEY.match(name):
            out[f"{prefix}/{BY_UPDATE}/{label}/{name}"] = value
    return out
