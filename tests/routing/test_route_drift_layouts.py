"""Route drift under the layouts verl uses on GPU, on CPU: virtual pipeline stages (megatron's interleaved order)
and THD packing with its padding rows (TP and CP alignment).

The interleaved order is megatron-core 0.16.1's own ``get_schedule_table``; the packing is verl 0.9.1's own
``preprocess_thd_engine`` / ``set_router_replay_data`` (for R3 also ``align_r3_router_replay_data`` and
``build_r3_replay_mask``) feeding the routers of a tiny megatron-core GPTModel (gloo world of size 1, the package's
CPU patch of megatron-core). A world of size 1 has TP = CP = 1, so for the packing alone verl's packing module is
shown TP = 2 and/or CP = 2 (its ``mpu`` name replaced by a view of megatron's parallel state with those sizes, rank
0): the rows it builds are those of CP rank 0 (TP ranks then split them further for sequence parallelism, which does
not change which rows are padding). The whole-model gloo run of PP x VPP is in ``test_megatron_pipeline_routing.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("megatron.core")

from support.router_replay import verl_router_replay_patch

from respo_verl.cpu.kit.megatron_moe import NUM_EXPERTS, TOP_K, VOCAB, megatron_cpu, tiny_gpt_moe
from respo_verl.routing.diagnostics import RouteDriftStats
from respo_verl.routing.megatron import RouteDriftMonitor, find_replay_routers

# -- virtual pipeline stages ---------------------------------------------------------------------------------------


def test_unequal_micro_batches_in_megatron_s_interleaved_order_are_each_counted_once():
    """One pipeline stage with two chunks (layers 0-1 and 4-5), four micro-batches of 12, 10, 12 and 8 tokens,
    forwarded in megatron's interleaved order; every (micro-batch, layer) flips its own set of tokens."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    chunk_layers = {0: (0, 1), 1: (4, 5)}
    sizes = (12, 10, 12, 8)
    stats = RouteDriftStats([0, 1, 4, 5], {layer: c for c, layers in chunk_layers.items() for layer in layers})
    generator = torch.Generator().manual_seed(0)
    flipped_any = {m: torch.zeros(n, dtype=torch.bool) for m, n in enumerate(sizes)}
    flipped_per_layer = dict.fromkeys((0, 1, 4, 5), 0)
    order = get_schedule_table(len(sizes), len(chunk_layers), microbatch_group_size_per_vp_stage=2)
    assert order[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]  # chunk 1 of micro-batch 0 after chunk 0 of micro-batch 1
    for micro_batch, chunk in order:
        for layer in chunk_layers[chunk]:
            tokens = sizes[micro_batch]
            native = torch.stack([torch.randperm(8, generator=generator)[:TOP_K] for _ in range(tokens)])
            flips = torch.rand(tokens, generator=generator) < 0.3
            replayed = native.clone()
            for t in torch.nonzero(flips).flatten().tolist():
                replayed[t, -1] = next(e for e in range(8) if e not in native[t].tolist())
            stats.update(layer, replayed, native, probs=None)
            flipped_any[micro_batch] |= flips
            flipped_per_layer[layer] += int(flips.sum())
    metrics = stats.metrics()
    total = sum(sizes)
    assert metrics["actor/routing/replayed_tokens"] == total
    assert metrics["actor/routing/any_layer_flip_frac"] == sum(int(f.sum()) for f in flipped_any.values()) / total
    for layer, count in flipped_per_layer.items():
        assert metrics[f"actor/routing/flip_frac/layer_{layer}"] == count / total


def test_a_micro_batch_of_another_size_within_one_chunk_is_an_error():
    stats = RouteDriftStats([0, 1, 4, 5], {0: 0, 1: 0, 4: 1, 5: 1})
    routes = torch.tensor([[0, 1]] * 6)
    stats.update(0, routes, routes, probs=None)
    with pytest.raises(ValueError, match="MoE layer 1 routed 4 tokens in micro-batch 0, but layer 0 routed 6"):
        stats.update(1, routes[:4], routes[:4], probs=None)


def test_the_chunk_map_must_cover_the_layers():
    with pytest.raises(ValueError, match="chunk_of covers layers"):
        RouteDriftStats([0, 1], {0: 0})


# -- THD packing: R2's padding rows -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_world():
    with megatron_cpu():
        yield


@pytest.fixture
def verl_patch():
    """verl's apply_router_replay_patch() for one test; megatron-core's classes are restored afterwards."""
    with verl_router_replay_patch():
        yield


class _ParallelSizes:
    """megatron's ``parallel_state`` as verl's packing module sees it, with other TP and CP sizes (rank 0)."""

    def __init__(self, tp: int, cp: int):
        from megatron.core import parallel_state

        self._state, self._tp, self._cp = parallel_state, tp, cp

    def __getattr__(self, name):
        return getattr(self._state, name)

    def get_tensor_model_parallel_world_size(self):
        return self._tp

    def get_context_parallel_world_size(self):
        return self._cp

    def get_context_parallel_rank(self):
        return 0


@contextlib.contextmanager
def _packing_as(tp: int, cp: int):
    """verl's packing with TP and CP of these sizes (rank 0), and its replay data left on the CPU."""
    from unittest import mock

    from verl.models.mcore import util
    from verl.utils.megatron import router_replay_utils

    with (
        mock.patch.object(util, "mpu", _ParallelSizes(tp, cp)),
        mock.patch.object(router_replay_utils, "device_name", "cpu"),
    ):
        yield


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def _pack(rows: list[torch.Tensor]) -> torch.Tensor:
    """verl's packing of per-sequence values into this rank's rows (padding rows 0)."""
    from verl.models.mcore.util import preprocess_thd_engine

    packed, _, _ = preprocess_thd_engine(_nested(rows), pre_process=True)
    return packed.reshape(-1, *packed.shape[2:]) if packed.dim() > 2 else packed.reshape(-1)


LENGTHS = (5, 4, 3, 7)  # odd lengths: padding rows under any alignment > 1


class _ThdRows(NamedTuple):
    """This rank's rows of a batch packed by verl's THD packing."""

    ids: torch.Tensor  # (rows,) token ids; padding rows hold token 0
    valid: torch.Tensor  # (rows,) bool: a real token, not padding
    owner: torch.Tensor  # (rows,) the sequence each real row belongs to
    position: torch.Tensor  # (rows,) each real row's position in its sequence
    attention_mask: torch.Tensor  # (1, 1, rows, rows), True = masked


def _thd_rows(sequences: list[torch.Tensor], tp: int, cp: int) -> _ThdRows:
    """verl's packing of ``sequences`` with TP and CP of these sizes (rank 0), and a CPU attention mask for it."""
    from verl.models.mcore.util import preprocess_thd_engine

    lengths = [s.shape[0] for s in sequences]
    with _packing_as(tp, cp):
        packed_ids, params, _ = preprocess_thd_engine(_nested(sequences), pre_process=True)
        valid = _pack([torch.ones(n, dtype=torch.long) for n in lengths]).bool()
        owner = _pack([torch.full((n,), i) for i, n in enumerate(lengths)])
        position = _pack([torch.arange(n) for n in lengths])
    ids = packed_ids.reshape(-1)
    rows = ids.shape[0]
    assert 0 < int(valid.sum()) < rows, "the layout must produce padding rows"
    # THD attention on CPU: causal within each sequence's rows of this rank (cu_seqlens_padded / CP), so that, as in
    # verl's THD forward, no real token sees another sequence or a padding row (which sit after a sequence's tokens).
    bounds = (params.cu_seqlens_q_padded // cp).tolist()
    segment = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(itertools.pairwise(bounds))])
    assert segment.shape[0] == rows
    causal = torch.triu(torch.ones(rows, rows, dtype=torch.bool), diagonal=1) | (segment[:, None] != segment[None])
    return _ThdRows(ids, valid, owner, position, causal[None, None])


def _forward_rows(model, batch: _ThdRows, action: str) -> None:
    """One forward of the packed rows with every router's replay action set to ``action``."""
    routers = find_replay_routers(model)
    actions = sys.modules[type(routers[min(routers)].router_replay).__module__].RouterReplayAction
    for router in routers.values():
        router.router_replay.router_replay_action = actions[action]
    rows = batch.ids.shape[0]
    with torch.no_grad():
        model(batch.ids[None], torch.arange(rows)[None], attention_mask=batch.attention_mask)


def _record_rows(model, batch: _ThdRows) -> torch.Tensor:
    """(rows, layers, k): the routes the routers choose for this rank's rows (RECORD), replay data cleared after."""
    routers = find_replay_routers(model)
    _forward_rows(model, batch, "RECORD")
    recorded = torch.stack([routers[layer].router_replay.recorded_topk_idx for layer in sorted(routers)], dim=1)
    for router in routers.values():
        router.router_replay.clear_indices()
    return recorded


def _sequence_routes(batch: _ThdRows, recorded: torch.Tensor, lengths) -> list[torch.Tensor]:
    """Per-sequence (n, layers, k) routes: ``recorded`` on this rank's real rows. verl's record path returns whole
    sequences (CP ranks gathered); the rows other CP ranks hold get some valid route here (they are packed into the
    other ranks' shards)."""
    layers = recorded.shape[1]
    routes = [torch.arange(TOP_K).repeat(n, layers, 1) + 1 for n in lengths]
    for row in torch.nonzero(batch.valid).flatten().tolist():
        position = int(batch.position[row])
        if position < routes[int(batch.owner[row])].shape[0]:
            routes[int(batch.owner[row])][position] = recorded[row]
    return routes


@pytest.mark.parametrize(("tp", "cp"), [(2, 1), (1, 2), (2, 2)])
def test_r2_through_verl_s_thd_packing_counts_no_padding_row(cpu_world, verl_patch, tp, cp):
    """R2 on unchanged weights: π_old's routes, packed by verl as its engine packs them (each sequence padded to a
    multiple of TP·CP·2 with CP, of TP without), replayed into the same forward. Nothing can have flipped, and verl's
    padding rows (expert 0 repeated k times) must not be counted."""
    from verl.utils.megatron.router_replay_utils import set_router_replay_data

    model = tiny_gpt_moe()
    routers = find_replay_routers(model)
    layers = sorted(routers)
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(1, VOCAB, (n,), generator=generator) for n in LENGTHS]
    batch = _thd_rows(sequences, tp, cp)
    valid, rows = batch.valid, batch.ids.shape[0]

    # π_old's pass records this rank's rows.
    recorded = _record_rows(model, batch)
    routes = _sequence_routes(batch, recorded, LENGTHS)

    # The update's pass: verl packs the routes again (padding rows become zeros) and sets them on the routers.
    with RouteDriftMonitor(model) as monitor:
        with monitor.step():
            with _packing_as(tp, cp):
                set_router_replay_data(_nested(routes), None, model.config, model=[model])
            assert routers[0].router_replay.target_topk_idx.shape == (rows, TOP_K)
            padding = ~valid
            assert (routers[0].router_replay.target_topk_idx[padding] == 0).all()
            for i, layer in enumerate(layers):
                assert torch.equal(routers[layer].router_replay.target_topk_idx[valid], recorded[valid, i]), layer
            _forward_rows(model, batch, "REPLAY_FORWARD")
        metrics = monitor.metrics()
    assert metrics["actor/routing/replayed_tokens"] == int(valid.sum())
    assert metrics["actor/routing/flip_frac"] == 0.0
    assert metrics["actor/routing/any_layer_flip_frac"] == 0.0
    assert metrics["actor/routing/prob_mass_delta"] <= 0.0
    for layer in layers:
        assert metrics[f"actor/routing/flip_frac/layer_{layer}"] == 0.0


# -- THD packing: R3's rollout routes and padding rows ---------------------------------------------------------------

R3_FLIPS = 3  # replayed real tokens whose rollout route (last layer) differs from the router's choice


@pytest.mark.parametrize("replay_mask", ["verl_r3", "none"])
@pytest.mark.parametrize(
    ("tp", "cp", "route_dtype"), [(2, 1, "int16"), (1, 2, "int16"), (2, 2, "int16"), (2, 2, "uint8")]
)
def test_r3_through_verl_s_thd_packing_counts_the_rollout_s_flips_and_no_padding_row(
    cpu_world, verl_patch, monkeypatch, tp, cp, replay_mask, route_dtype
):
    """R3: the rollout's routes of the real tokens, packed by verl as its engine packs them for R3 (each sequence
    padded to a multiple of TP·CP·2 with CP, of TP without; padding rows expert 0 repeated k times), replayed into
    the trainer's forward. The rollout's routes are the router's own choice except for R3_FLIPS replayed tokens in
    the last layer (one expert swapped), so exactly those flips are counted, in that layer only (the layers before it
    see unchanged inputs), over exactly the replayed real tokens, and no padding row is counted in any layer.

    ``verl_r3``: as verl's engine in R3 mode: the rollout has no route for a sequence's final token
    (``align_r3_router_replay_data`` adds a zero placeholder) and ``build_r3_replay_mask`` leaves that row native;
    the mask is packed like the routes (padding rows False), so the replayed tokens are the real tokens less each
    sequence's final one. ``none``: the rollout's routes for every token and no replay mask, so every real token is
    replayed and the monitor's own padding-row test is what keeps the padding rows out.

    ``route_dtype``: verl's int16, or vLLM's uint8 that respo-verl keeps (ROUTES_UINT8); either way verl packs them
    as they are and each router receives int64 (tokens, k), widened on the device."""
    from verl.utils.megatron.router_replay_utils import (
        align_r3_router_replay_data,
        build_r3_replay_mask,
        set_router_replay_data,
    )

    model = tiny_gpt_moe()
    routers = find_replay_routers(model)
    layers = sorted(routers)
    last = layers[-1]
    generator = torch.Generator().manual_seed(4)
    sequences = [torch.randint(1, VOCAB, (n,), generator=generator) for n in LENGTHS]
    batch = _thd_rows(sequences, tp, cp)
    valid, rows = batch.valid, batch.ids.shape[0]
    padding = ~valid

    # What the trainer's router chooses for this rank's rows; the rollout agrees except on R3_FLIPS tokens.
    native = _record_rows(model, batch)
    lengths = [max(n - 1, 0) for n in LENGTHS] if replay_mask == "verl_r3" else list(LENGTHS)
    final = torch.tensor(LENGTHS)[batch.owner] - 1 == batch.position
    replayed = valid & ~final if replay_mask == "verl_r3" else valid
    real_replayed = int(replayed.sum())
    flipped_rows = torch.nonzero(replayed).flatten()[::2][:R3_FLIPS]
    assert flipped_rows.numel() == R3_FLIPS
    rollout = native.clone()
    for row in flipped_rows.tolist():
        taken = rollout[row, last].tolist()
        rollout[row, last, -1] = next(e for e in range(NUM_EXPERTS) if e not in taken)
    routes = [r.to(getattr(torch, route_dtype)) for r in _sequence_routes(batch, rollout, lengths)]

    counted: list[tuple[int, torch.Tensor | None]] = []  # (layer, token mask) of every update the monitor makes
    with RouteDriftMonitor(model) as monitor:
        update = monitor._stats.update

        def recording_update(layer, replayed_topk_idx, native_topk_idx, probs, token_mask=None):
            counted.append((layer, None if token_mask is None else token_mask.clone()))
            return update(layer, replayed_topk_idx, native_topk_idx, probs, token_mask)

        monkeypatch.setattr(monitor._stats, "update", recording_update)
        with monitor.step():
            input_ids = _nested(sequences)
            route_data, mask = _nested(routes), None
            if replay_mask == "verl_r3":
                route_data = align_r3_router_replay_data(route_data, input_ids)
                response_mask = torch.ones(len(LENGTHS), 2, dtype=torch.long)  # the last 2 tokens: the response
                mask = build_r3_replay_mask(input_ids, response_mask)
            with _packing_as(tp, cp):
                set_router_replay_data(route_data, None, model.config, replay_mask=mask, model=[model])
            assert route_data.dtype == getattr(torch, route_dtype)  # what verl's engine hands set_router_replay_data
            target = routers[last].router_replay.target_topk_idx
            assert target.shape == (rows, TOP_K) and target.dtype == torch.int64
            assert (target[padding] == 0).all()  # verl's padding rows
            for i, layer in enumerate(layers):
                rollout_rows = routers[layer].router_replay.target_topk_idx[replayed]
                assert torch.equal(rollout_rows, rollout[replayed, i]), layer
            if replay_mask == "verl_r3":
                assert torch.equal(routers[last].router_replay.target_replay_mask.bool(), replayed)
                assert (target[valid & final] == 0).all()  # align_r3_router_replay_data's placeholders
            _forward_rows(model, batch, "REPLAY_FORWARD")
        metrics = monitor.metrics()

    assert metrics["actor/routing/replayed_tokens"] == real_replayed
    assert metrics[f"actor/routing/flip_frac/layer_{last}"] == R3_FLIPS / real_replayed
    assert metrics[f"actor/routing/overlap/layer_{last}"] == pytest.approx(1 - R3_FLIPS / (real_replayed * TOP_K))
    for layer in layers[:-1]:
        assert metrics[f"actor/routing/flip_frac/layer_{layer}"] == 0.0, layer
        assert metrics[f"actor/routing/overlap/layer_{layer}"] == 1.0, layer
    assert metrics["actor/routing/any_layer_flip_frac"] == R3_FLIPS / real_replayed
    assert metrics["actor/routing/flip_frac"] == R3_FLIPS / (real_replayed * len(layers))
    assert sorted(layer for layer, _ in counted) == layers  # one forward, each layer counted once
    for layer, token_mask in counted:
        assert token_mask is not None, layer
        assert torch.equal(token_mask, replayed), layer  # the replayed real tokens; never a padding row
