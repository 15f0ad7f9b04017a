"""Pipeline-parallel bookkeeping of the route-drift diagnostics: two gloo ranks, PP = 2 (and VPP = 2), TP = 1, CPU.

Two processes (``torch.multiprocessing`` spawn, ``env://`` rendezvous on 127.0.0.1 and a free port) form a gloo world
of size 2; each runs megatron-core 0.16.1's ``initialize_model_parallel(1, 2)`` under the CPU patch of megatron-core
(:func:`respo_verl.cpu.kit.megatron_moe.megatron_cpu`) and builds its pipeline stage of the tiny GPTModel MoE
of ``test_megatron_routing.py``, with 4 layers: stage 0 holds global layers 0-1 (embedding), stage 1 layers 2-3
(output layer). Every forward goes through megatron's real pipeline schedule (``get_forward_backward_func()``, 1F1B
without interleaving): activations and gradients travel between the ranks by ``torch.distributed`` isend/irecv over
gloo. Two additions to the CPU patch, local to this file: the schedule allocates a token counter with
``device="cuda"`` (redirected to the CPU, in megatron's ``schedules`` module only), and ``batch_p2p_comm=False`` (its
batched path calls ``torch.cuda.synchronize``).

Each rank checks:

1. bookkeeping: the monitor attaches to exactly the stage's own routers and keys them by GLOBAL layer index, the
   same range megatron's ``get_transformer_layer_offset`` and verl 0.9.1's ``get_current_rank_layer_info`` /
   ``iter_model_routers`` give (which decide which rows of verl's replay tensor a stage's routers receive); the
   stage, loaded with the weights of the whole 4-layer model, reproduces that model's logits and its routes under
   the same global layer indices (so "layer 2" on stage 1 is the whole model's layer 2);
2. a constructed drift (m of n tokens forced to flip in global layer 3, on stage 1) reads m/n for layer 3 and 0 for
   every other layer, on the stage that holds it; stage 0 reports zero drift for its layers 0-1;
3. through the real route-drift engine (verl 0.9.1's ``MegatronEngineWithLMHead`` subclassed, with a stand-in
   body that runs the pipeline schedule forward and backward; as in ``test_engine_routing_metrics.py``), the
   per-layer counts are all-reduced
   over both ranks: both ranks hold the same metrics, with every global layer present, layer 3 at m/n, and
   ``any_layer_flip_frac`` per stage.

A second test runs megatron's interleaved 1F1B schedule (PP = 2 x VPP = 2, 8 layers in 4 chunks of 2) forward and
backward over 4 micro-batches of unequal length (12, 10, 12, 8 tokens; ``variable_seq_lengths``, as verl sets it
under PP, so each activation's shape travels ahead of it): each micro-batch's routes are recorded, then replayed
with replay data set per chunk and micro-batch, a different number of tokens flipped in the last layer per
micro-batch. Each stage counts every micro-batch once, whatever the interleaving of its chunks: replayed tokens and
flip fractions are the exact sums over the micro-batches. The chunks take the point-to-point settings verl 0.9.1 and
mbridge give a model with VPP > 1 (``overlap_p2p_comm=True``, ``batch_p2p_comm=False``): with
``overlap_p2p_comm=False`` megatron-core 0.16.1 exchanges activation and gradient shapes in one call at PP = 2 and
crosses them (NVIDIA/Megatron-LM#5100; on gloo the tensor that follows no longer fits its buffer).

Each test runs under a hard deadline (``TIMEOUT_S``); a hung collective kills both ranks and fails the test.
"""

from __future__ import annotations

import datetime
import math
import os

import pytest
import torch
from support.ranks import free_port, run_ranks

pytest.importorskip("megatron.core")

from respo_verl.cpu.kit.megatron_moe import BATCH, NUM_EXPERTS, SEQ, TOP_K, VOCAB, forward, megatron_cpu, tiny_gpt_moe

PP = 2
LAYERS = 4  # PP stages of LAYERS // PP layers each
DRIFT_LAYER = LAYERS - 1  # on the last stage; layers before it see unchanged inputs
FLIPS = 5
MICRO_BATCHES = 2  # the schedule pipelines them (warm-up / steady state / cool-down)
TOKENS = BATCH * SEQ  # per micro-batch
TIMEOUT_S = 120
_GPT_KWARGS = dict(share_embeddings_and_output_weights=False)


@pytest.mark.slow
def test_pipeline_stages_report_global_layers_and_reduce_consistently():
    run_ranks(_worker, (free_port(),), PP, TIMEOUT_S, "two-rank pipeline test")


# -- one rank ---------------------------------------------------------------------------------------------------


def _worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(PP))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=PP, timeout=datetime.timedelta(seconds=TIMEOUT_S // 2))
    try:
        _check_rank(rank)
    finally:
        dist.destroy_process_group()


def _check_rank(rank: int) -> None:
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    # Reference: the whole model (PP = 1; the two ranks are data-parallel replicas of it), its logits and routes.
    with megatron_cpu():
        whole = tiny_gpt_moe(num_layers=LAYERS, gpt_kwargs=_GPT_KWARGS)
        whole_logits, whole_routes = _record_whole(whole, input_ids)
        whole_state = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in whole.state_dict().items()}
        del whole

    with megatron_cpu(pipeline_model_parallel_size=PP), _schedule_on_cpu():
        _check_stage(rank, input_ids, whole_logits, whole_routes, whole_state)


def _check_stage(rank, input_ids, whole_logits, whole_routes, whole_state) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from verl.utils.megatron.router_replay_utils import get_current_rank_layer_info, iter_model_routers

    from respo_verl.routing.megatron import RouteDriftMonitor, find_replay_routers

    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    assert mpu.get_pipeline_model_parallel_rank() == rank and (first, last) == (rank == 0, rank == PP - 1)
    stage = tiny_gpt_moe(
        num_layers=LAYERS,
        pipeline_model_parallel_size=PP,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,
        gpt_kwargs=dict(_GPT_KWARGS, pre_process=first, post_process=last),
    )
    per_stage = LAYERS // PP
    expected = list(range(rank * per_stage, (rank + 1) * per_stage))

    # (1) Megatron's, verl's and our layer bookkeeping agree on this stage's global layers.
    offset = get_transformer_layer_offset(stage.config)
    assert list(range(offset, offset + per_stage)) == expected
    assert get_current_rank_layer_info(stage.config) == {"start": expected[0], "end": expected[-1] + 1, "count": 2}
    assert sorted(number - 1 for number, _ in iter_model_routers([stage])) == expected
    routers = find_replay_routers([stage])
    assert sorted(routers) == expected
    own = [module for module in stage.modules() if isinstance(module, TopKRouter)]
    assert {id(r) for r in routers.values()} == {id(r) for r in own} and len(own) == per_stage
    stage.load_state_dict(_stage_state(stage, whole_state, offset), strict=True)

    monitor = RouteDriftMonitor.attach([stage])
    assert monitor.layers == tuple(expected)
    assert all(getattr(r.router_replay, "_respo_route_drift_monitor", None) is monitor for r in own)
    layer_keys = {key for key in monitor.metrics(reset=False) if "/layer_" in key}
    assert layer_keys == {f"actor/routing/{name}/layer_{layer}" for name in _PER_LAYER for layer in expected}

    # The stage reproduces the whole model: same logits on the last stage, same routes under the same global index.
    logits, routes = _pipeline_record(stage, input_ids)
    assert routes.keys() == set(expected)
    for layer in expected:
        assert torch.equal(routes[layer], whole_routes[layer]), layer
    if last:
        torch.testing.assert_close(logits, whole_logits, rtol=1e-5, atol=1e-5)

    # (2) A constructed drift in global layer 3 (stage 1): m/n there, 0 elsewhere, on the stage that holds it.
    drifted = {layer: (_flip(idx, range(FLIPS)) if layer == DRIFT_LAYER else idx) for layer, idx in routes.items()}
    with monitor.step():
        _pipeline_replay(stage, input_ids, drifted)
    _clear(stage)
    local = monitor.metrics()
    assert local["actor/routing/replayed_tokens"] == MICRO_BATCHES * TOKENS
    for layer in expected:
        flip = FLIPS / TOKENS if layer == DRIFT_LAYER else 0.0
        assert local[f"actor/routing/flip_frac/layer_{layer}"] == flip, (layer, local)
        assert local[f"actor/routing/overlap/layer_{layer}"] == pytest.approx(1 - flip / TOP_K)
        assert (local[f"actor/routing/prob_mass_delta/layer_{layer}"] < 0) == (layer == DRIFT_LAYER)
    assert local["actor/routing/any_layer_flip_frac"] == (FLIPS / TOKENS if DRIFT_LAYER in expected else 0.0)
    monitor.remove()

    # (3) The route-drift engine all-reduces the per-layer counts: both ranks end with the same, whole-model metrics.
    metrics = _engine_step(stage, input_ids, drifted)
    per_layer = {f"routing/{name}/layer_{layer}" for name in _PER_LAYER for layer in range(LAYERS)}
    assert per_layer <= metrics.keys(), sorted(metrics)
    for layer in range(LAYERS):
        assert metrics[f"routing/flip_frac/layer_{layer}"] == (FLIPS / TOKENS if layer == DRIFT_LAYER else 0.0)
    assert metrics["routing/flip_frac"] == pytest.approx(FLIPS / (LAYERS * TOKENS))
    assert metrics["routing/replayed_tokens"] == MICRO_BATCHES * TOKENS  # per stage, not summed over stages
    assert "routing/any_layer_flip_frac" not in metrics
    assert metrics["routing/any_layer_flip_frac/pp_stage_0"] == 0.0
    assert metrics["routing/any_layer_flip_frac/pp_stage_1"] == FLIPS / TOKENS
    gathered = [None] * PP
    dist.all_gather_object(gathered, metrics)
    assert gathered[0].keys() == gathered[1].keys()
    for key in gathered[0]:
        same = gathered[0][key] == gathered[1][key] or (math.isnan(gathered[0][key]) and math.isnan(gathered[1][key]))
        assert same, (key, gathered[0][key], gathered[1][key])


_PER_LAYER = ("flip_frac", "overlap", "prob_mass_delta")


def _stage_state(stage, whole_state: dict, offset: int) -> dict:
    """The whole model's weights under the stage's names: local layer ``i`` is global layer ``offset + i``."""
    state = {}
    for key in stage.state_dict():
        source = key
        if key.startswith("decoder.layers."):
            local, rest = key[len("decoder.layers.") :].split(".", 1)
            source = f"decoder.layers.{int(local) + offset}.{rest}"
        state[key] = whole_state[source]
    return state


# -- routing replay helpers (megatron-core's native RouterReplay) -----------------------------------------------


def _set_action(model, name: str | None) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from respo_verl.routing.megatron import find_replay_routers

    for router in find_replay_routers([model]).values():
        router.router_replay.router_replay_action = None if name is None else RouterReplayAction[name]


def _clear(model) -> None:
    from respo_verl.routing.megatron import find_replay_routers

    for router in find_replay_routers([model]).values():
        router.router_replay.clear_indices()
        router.router_replay.router_replay_action = None


def _recorded(model) -> dict[int, torch.Tensor]:
    from respo_verl.routing.megatron import find_replay_routers

    return {layer: r.router_replay.recorded_topk_idx.clone() for layer, r in find_replay_routers([model]).items()}


def _flip(topk_idx: torch.Tensor, tokens) -> torch.Tensor:
    """Replace the last expert of each given token by one outside its top-k: that token's set flips."""
    flipped = topk_idx.clone()
    for t in tokens:
        flipped[t, -1] = next(e for e in range(NUM_EXPERTS) if e not in topk_idx[t].tolist())
    return flipped


def _record_whole(model, input_ids):
    _set_action(model, "RECORD")
    with torch.no_grad():
        logits = forward(model, input_ids)
    routes = _recorded(model)
    _clear(model)
    return logits, routes


# -- megatron's pipeline schedule on CPU ------------------------------------------------------------------------


class _CpuTorch:
    """``torch`` as megatron's ``schedules`` module sees it, with ``device="cuda"`` allocations on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def _schedule_on_cpu():
    from unittest import mock

    from megatron.core.pipeline_parallel import schedules

    return mock.patch.object(schedules, "torch", _CpuTorch())


def _run_schedule(model, input_ids, forward_only: bool) -> list:
    """Run ``MICRO_BATCHES`` copies of ``input_ids`` through megatron's pipeline schedule; the last stage returns
    each micro-batch's logits (in ``{"logits": ...}``), the other stages an empty list."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, stage_model):
        output = forward(stage_model, next(data_iterator))  # hidden states on stage 0, logits on the last stage

        def loss_func(logits):
            return logits.square().mean(), {"logits": logits.detach()}

        return output, loss_func

    with torch.set_grad_enabled(not forward_only):
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([input_ids] * MICRO_BATCHES),
            model=[model],
            num_microbatches=MICRO_BATCHES,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            forward_only=forward_only,
        )


def _pipeline_record(model, input_ids):
    _set_action(model, "RECORD")
    outputs = _run_schedule(model, input_ids, forward_only=True)
    routes = _recorded(model)  # both micro-batches are the same tokens: the last record is the routes of either
    _clear(model)
    logits = outputs[-1]["logits"] if outputs else None
    return logits, routes


def _set_routes(model, routes) -> None:
    from respo_verl.routing.megatron import find_replay_routers

    for layer, router in find_replay_routers([model]).items():
        router.router_replay.set_target_indices(routes[layer])


def _pipeline_replay(model, input_ids, routes, forward_only: bool = True) -> list:
    _set_routes(model, routes)
    _set_action(model, "REPLAY_FORWARD")
    return _run_schedule(model, input_ids, forward_only=forward_only)


# -- the route-drift engine -------------------------------------------------------------------------------------------


def _engine_step(stage, input_ids, routes) -> dict[str, float]:
    """One training call of the route-drift engine; verl's CUDA-only body is replaced (for the test) by a stand-in
    that replays ``routes`` through the pipeline schedule (forward and backward) and clears them."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from respo_verl.routing.engine import engine_classes

    def stand_in(self, data, loss_function, forward_only=False):
        try:
            _pipeline_replay(self.module[0], input_ids, routes, forward_only=forward_only)
        finally:
            _clear(self.module[0])
        return {"model_output": {}, "loss": [0.0], "metrics": {}}

    verl_body = vars(MegatronEngine)["forward_backward_batch"]
    MegatronEngine.forward_backward_batch = stand_in
    try:
        engine = object.__new__(engine_classes()["language_model"])
        engine.module = [stage]
        engine.enable_routing_replay = True
        engine.tf_config = stage.config
        engine.is_mp_src_rank_with_outputs = lambda: True  # every rank hands back its metrics, to compare them
        data = _replay_batch(input_ids)
        output = engine.forward_backward_batch(data, loss_function=None, forward_only=False)
        engine._route_drift.close()
    finally:
        MegatronEngine.forward_backward_batch = verl_body
    stage.zero_grad(set_to_none=True)
    return {key: value[0] for key, value in output["metrics"].items()}


def _replay_batch(input_ids):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    data = TensorDict({"input_ids": input_ids}, batch_size=[BATCH])
    tu.assign_non_tensor(data, enable_routing_replay=True)
    return data


# -- virtual pipeline stages: megatron's interleaved schedule --------------------------------------------------------

VPP = 2
VPP_LAYERS = 8  # PP x VPP chunks of 2 layers: stage 0 holds layers 0-1 and 4-5, stage 1 layers 2-3 and 6-7
VPP_SEQ_LENS = (6, 5, 6, 4)  # per micro-batch, each its own tokens: BATCH x these = 12, 10, 12, 8 routed tokens
VPP_MICRO_BATCHES = len(VPP_SEQ_LENS)
VPP_DRIFT_LAYER = VPP_LAYERS - 1  # chunk 1 of stage 1: the last layer, so no other layer's inputs change
VPP_FLIPS = (1, 3, 0, 5)  # tokens flipped in the drift layer, per micro-batch: every micro-batch differs


@pytest.mark.slow
def test_virtual_pipeline_stages_count_each_micro_batch_once_in_the_interleaved_order():
    """PP = 2 x VPP = 2 under megatron's interleaved 1F1B schedule, forward and backward, over micro-batches of
    unequal length (12, 10, 12, 8 tokens, with ``variable_seq_lengths`` as verl sets it under PP). Each micro-batch's
    routes are recorded in a forward-only pass and replayed with the replay data set per chunk and micro-batch, as
    verl's ``forward_step`` sets it. Each chunk's routers see micro-batches 0, 1, 2, 3 in that order, interleaved
    with the other chunk's (chunk 1 of micro-batch 0 runs after chunk 0 of micro-batch 1). Every micro-batch flips a
    different number of tokens in the last layer: the stage that holds it counts every micro-batch once (replayed
    tokens: the sum of the four sizes) and reports exactly the flips summed over the tokens summed, in that layer and
    in ``any_layer_flip_frac``, and 0 in every other layer; the other stage reports zero drift."""
    run_ranks(_vpp_worker, (free_port(),), PP, TIMEOUT_S, "two-rank virtual-pipeline test")


def _vpp_worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(PP))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=PP, timeout=datetime.timedelta(seconds=TIMEOUT_S // 2))
    try:
        with megatron_cpu(pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=VPP):
            with _schedule_on_cpu():
                _check_vpp_rank(rank)
    finally:
        dist.destroy_process_group()


def _check_vpp_rank(rank: int) -> None:
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    from respo_verl.routing.megatron import RouteDriftMonitor, find_replay_routers

    first, last = mpu.is_pipeline_first_stage(ignore_virtual=True), mpu.is_pipeline_last_stage(ignore_virtual=True)
    chunks = []
    for vp_stage in range(VPP):
        chunks.append(
            tiny_gpt_moe(
                seed=vp_stage,
                num_layers=VPP_LAYERS,
                pipeline_model_parallel_size=PP,
                virtual_pipeline_model_parallel_size=VPP,
                microbatch_group_size_per_vp_stage=PP,
                pipeline_dtype=torch.float32,
                variable_seq_lengths=True,
                batch_p2p_comm=False,
                overlap_p2p_comm=True,
                gpt_kwargs=dict(
                    _GPT_KWARGS,
                    pre_process=first and vp_stage == 0,
                    post_process=last and vp_stage == VPP - 1,
                    vp_stage=vp_stage,
                ),
            )
        )
    per_chunk = VPP_LAYERS // (PP * VPP)
    expected = {
        vp_stage: list(range((vp_stage * PP + rank) * per_chunk, (vp_stage * PP + rank + 1) * per_chunk))
        for vp_stage in range(VPP)
    }
    for vp_stage, chunk in enumerate(chunks):
        assert sorted(find_replay_routers([chunk])) == expected[vp_stage], vp_stage
    layers = [layer for chunk_layers in expected.values() for layer in chunk_layers]
    # The order this test relies on: megatron interleaves the chunks' micro-batches.
    table = get_schedule_table(VPP_MICRO_BATCHES, VPP, PP)
    assert table[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]

    micro_batches = [
        torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(m))
        for m, seq in enumerate(VPP_SEQ_LENS)
    ]
    sizes = [BATCH * seq for seq in VPP_SEQ_LENS]  # tokens each router routes per micro-batch
    # Record: each micro-batch's routes in every layer of this stage, one (tokens, top-k) tensor per layer.
    routes: dict[int, dict[int, torch.Tensor]] = {m: {} for m in range(VPP_MICRO_BATCHES)}
    for chunk in chunks:
        _set_action(chunk, "RECORD")
    _run_vpp_schedule(chunks, micro_batches, routes, replay=False, forward_only=True)
    for chunk in chunks:
        _clear(chunk)
    shapes = {m: {layer: tuple(idx.shape) for layer, idx in by_layer.items()} for m, by_layer in routes.items()}
    assert shapes == {m: dict.fromkeys(layers, (size, TOP_K)) for m, size in enumerate(sizes)}, shapes

    monitor = RouteDriftMonitor.attach(chunks)
    order: list[tuple[int, int]] = []
    with monitor.step():
        _run_vpp_schedule(chunks, micro_batches, routes, replay=True, forward_only=False, order=order)
    for chunk in chunks:
        _clear(chunk)
    # The forwards really ran interleaved: chunk 1 of micro-batch 0 after chunk 0 of micro-batch 1.
    assert order.index((0, 1)) > order.index((1, 0)), order
    metrics = monitor.metrics()
    monitor.remove()
    tokens = sum(sizes)
    flipped = sum(VPP_FLIPS) if VPP_DRIFT_LAYER in layers else 0
    assert metrics["actor/routing/replayed_tokens"] == tokens, metrics
    assert metrics["actor/routing/any_layer_flip_frac"] == flipped / tokens, metrics
    for layer in layers:
        flip = flipped / tokens if layer == VPP_DRIFT_LAYER else 0.0
        assert metrics[f"actor/routing/flip_frac/layer_{layer}"] == flip, (layer, metrics)


def _run_vpp_schedule(
    chunks,
    micro_batches: list[torch.Tensor],
    routes: dict[int, dict[int, torch.Tensor]],
    replay: bool,
    forward_only: bool,
    order: list[tuple[int, int]] | None = None,
) -> None:
    """Megatron's interleaved schedule over ``micro_batches`` (input ids, each of its own length). ``routes`` maps
    micro-batch -> global layer -> top-k indices: without ``replay``, each chunk's forward step stores there the
    routes its routers recorded for its micro-batch; with ``replay``, it sets its routers' replay data from there
    for its micro-batch (as verl's ``forward_step`` does), the drift layer's with ``VPP_FLIPS[m]`` tokens flipped.
    ``order`` receives (micro-batch, chunk) of every forward, in the order they ran."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from respo_verl.routing.megatron import find_replay_routers

    def forward_step(data_iterator, chunk):
        micro_batch = next(data_iterator)
        vp_stage = chunks.index(chunk)
        if order is not None:
            order.append((micro_batch, vp_stage))
        if replay:
            for layer, router in find_replay_routers([chunk]).items():
                flips = range(VPP_FLIPS[micro_batch]) if layer == VPP_DRIFT_LAYER else range(0)
                router.router_replay.set_target_indices(_flip(routes[micro_batch][layer], flips))
                router.router_replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD
        output = forward(chunk, micro_batches[micro_batch])
        if not replay:
            routes[micro_batch].update(_recorded(chunk))

        def loss_func(logits):
            return logits.square().mean(), {"logits": logits.detach()}

        return output, loss_func

    iterators = [iter(range(len(micro_batches))) for _ in chunks]
    with torch.set_grad_enabled(not forward_only):
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=chunks,
            num_microbatches=len(micro_batches),
            seq_length=max(VPP_SEQ_LENS),  # unused: with variable_seq_lengths each stage sends its shape first
            micro_batch_size=BATCH,
            forward_only=forward_only,
        )
