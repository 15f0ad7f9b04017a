"""Route-drift diagnostics on a tiny megatron-core 0.16.1 GPTModel on CPU (gloo world of size 1, the package's CPU
patch of megatron-core), through megatron-core's native replay seam and through verl 0.9.1's
``apply_router_replay_patch()``."""

from __future__ import annotations

import math
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from support.router_replay import verl_router_replay_patch

from respo_verl.cpu.kit.megatron_moe import (
    BATCH,
    NUM_EXPERTS,
    NUM_LAYERS,
    SEQ,
    TOP_K,
    VOCAB,
    forward,
    megatron_cpu,
    tiny_gpt_moe,
)
from respo_verl.routing.megatron import RouteDriftMonitor, find_replay_routers

TOKENS = BATCH * SEQ


@pytest.fixture(scope="module", autouse=True)
def cpu_world():
    with megatron_cpu():
        yield


@pytest.fixture
def input_ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def verl_patch():
    """verl's apply_router_replay_patch() for one test; megatron-core's classes are restored afterwards."""
    with verl_router_replay_patch():
        yield


def _actions(router):
    """The RouterReplayAction enum of whichever RouterReplay implementation the router carries."""
    return sys.modules[type(router.router_replay).__module__].RouterReplayAction


def _set_action(routers, name: str | None) -> None:
    for router in routers.values():
        replay = router.router_replay
        replay.router_replay_action = None if name is None else _actions(router)[name]


def _record(model, input_ids):
    routers = find_replay_routers(model)
    _set_action(routers, "RECORD")
    with torch.no_grad():
        logits = forward(model, input_ids)
    _set_action(routers, None)
    return logits, {layer: r.router_replay.recorded_topk_idx.clone() for layer, r in routers.items()}


def _set_routes(model, routes) -> None:
    for layer, router in find_replay_routers(model).items():
        router.router_replay.set_target_indices(routes[layer])


def _clear(model) -> None:
    for router in find_replay_routers(model).values():
        router.router_replay.clear_indices()
        router.router_replay.router_replay_action = None


def _replay(model, input_ids, routes, grad: bool = False):
    _set_routes(model, routes)
    _set_action(find_replay_routers(model), "REPLAY_FORWARD")
    with torch.set_grad_enabled(grad):
        return forward(model, input_ids)


def _flip(topk_idx: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    flipped = topk_idx.clone()
    for t in tokens:
        flipped[t, -1] = next(e for e in range(NUM_EXPERTS) if e not in topk_idx[t].tolist())
    return flipped


def _routing_maps(model):
    """Capture every router's routing_map (tokens, num_experts) of the next forward."""
    maps, handles = {}, []
    for layer, router in find_replay_routers(model).items():
        handles.append(router.register_forward_hook(lambda m, a, out, layer=layer: maps.__setitem__(layer, out[1])))
    return maps, handles


@pytest.mark.parametrize("path", ["native", "verl"])
def test_record_then_replay_is_exact(input_ids, path, request):
    if path == "verl":
        request.getfixturevalue("verl_patch")
    model = tiny_gpt_moe()
    routers = find_replay_routers(model)
    assert sorted(routers) == list(range(NUM_LAYERS))
    assert type(next(iter(routers.values())).router_replay).__module__.startswith(
        "verl." if path == "verl" else "megatron."
    )
    maps, handles = _routing_maps(model)
    native, routes = _record(model, input_ids)
    native_maps = dict(maps)
    with RouteDriftMonitor(model) as monitor, monitor.step():
        replayed = _replay(model, input_ids, routes)
    for handle in handles:
        handle.remove()
    _clear(model)
    assert torch.equal(replayed, native)
    for layer in routes:
        assert routes[layer].shape == (TOKENS, TOP_K)
        assert torch.equal(maps[layer], native_maps[layer])
    metrics = monitor.metrics()
    assert metrics["actor/routing/flip_frac"] == 0 and metrics["actor/routing/any_layer_flip_frac"] == 0
    assert metrics["actor/routing/overlap"] == 1 and metrics["actor/routing/prob_mass_delta"] == 0
    assert metrics["actor/routing/replayed_tokens"] == TOKENS


@pytest.mark.parametrize("path", ["native", "verl"])
def test_forced_routes_change_output_and_gradient_reaches_only_selected_experts(input_ids, path, request):
    if path == "verl":
        request.getfixturevalue("verl_patch")
    model = tiny_gpt_moe()
    native, routes = _record(model, input_ids)
    selected = (0, 1)
    forced = {layer: torch.tensor(selected).expand(TOKENS, TOP_K).contiguous() for layer in routes}
    logits = _replay(model, input_ids, forced, grad=True)
    logits.square().mean().backward()
    _clear(model)
    assert not torch.allclose(logits, native)
    for router in find_replay_routers(model).values():
        assert router.weight.grad is not None and router.weight.grad.norm() > 0  # gate weights stay live
    for name, module in model.named_modules():
        if name.endswith("experts.local_experts"):
            for expert, mlp in enumerate(module):
                norms = [p.grad.norm().item() if p.grad is not None else 0.0 for p in mlp.parameters()]
                assert (min(norms) > 0) if expert in selected else (max(norms) == 0), (name, expert, norms)


def test_replay_backward_recompute_matches_plain_backward(input_ids):
    grads = []
    for recompute in (False, True):
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        model = tiny_gpt_moe(**(extra if recompute else {}))
        _, routes = _record(model, input_ids)
        routes = {layer: _flip(idx, list(range(0, TOKENS, 3))) for layer, idx in routes.items()}
        with RouteDriftMonitor(model) as monitor, monitor.step():
            logits = _replay(model, input_ids, routes, grad=True)
            # megatron's recompute re-runs the forward inside backward: it must take the same routes.
            _set_action(find_replay_routers(model), "REPLAY_BACKWARD")
            logits.square().mean().backward()
        if recompute:
            assert all(not r.router_replay.replay_backward_list for r in find_replay_routers(model).values())
        assert monitor.metrics()["actor/routing/replayed_tokens"] == TOKENS  # the recompute is not counted
        _clear(model)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("path", ["native", "verl"])
@pytest.mark.parametrize("flips", [1, 5])
def test_diagnostics_are_exact_on_constructed_drift(input_ids, path, flips, request):
    if path == "verl":
        request.getfixturevalue("verl_patch")
    model = tiny_gpt_moe()
    last = NUM_LAYERS - 1
    _, routes = _record(model, input_ids)
    logits_by_layer = {}
    for layer, router in find_replay_routers(model).items():
        router.register_forward_pre_hook(
            lambda m, args, layer=layer: logits_by_layer.__setitem__(layer, m.gating(args[0]).view(-1, NUM_EXPERTS))
        )
    for drift_layer in (0, last):
        drifted = dict(routes)
        drifted[drift_layer] = _flip(routes[drift_layer], list(range(flips)))
        monitor = RouteDriftMonitor.attach(model)
        with monitor.step():
            _replay(model, input_ids, drifted)
        _clear(model)
        metrics = monitor.metrics()
        assert metrics[f"actor/routing/flip_frac/layer_{drift_layer}"] == flips / TOKENS
        assert metrics[f"actor/routing/overlap/layer_{drift_layer}"] == pytest.approx(1 - flips / (TOKENS * TOP_K))
        probs = torch.softmax(logits_by_layer[drift_layer].detach(), dim=-1)
        mass_delta = probs.gather(-1, drifted[drift_layer]).sum(-1) - probs.gather(-1, routes[drift_layer]).sum(-1)
        assert metrics[f"actor/routing/prob_mass_delta/layer_{drift_layer}"] == pytest.approx(
            mass_delta.mean().item(), abs=1e-6
        )
        assert metrics[f"actor/routing/prob_mass_delta/layer_{drift_layer}"] < 0
        if drift_layer == last:  # upstream layers see unchanged inputs: no drift there
            for layer in range(last):
                assert metrics[f"actor/routing/flip_frac/layer_{layer}"] == 0
            assert metrics["actor/routing/any_layer_flip_frac"] == flips / TOKENS
        else:
            assert metrics["actor/routing/any_layer_flip_frac"] >= flips / TOKENS
    monitor.remove()


def test_micro_batches_are_separate_forwards(input_ids):
    model = tiny_gpt_moe()
    _, routes = _record(model, input_ids)
    drifted = dict(routes)
    drifted[NUM_LAYERS - 1] = _flip(routes[NUM_LAYERS - 1], [0, 1, 2])
    with RouteDriftMonitor(model) as monitor, monitor.step():
        for micro_batch in (routes, drifted):
            _replay(model, input_ids, micro_batch)
    _clear(model)
    metrics = monitor.metrics()
    assert metrics["actor/routing/replayed_tokens"] == 2 * TOKENS
    assert metrics["actor/routing/any_layer_flip_frac"] == 3 / (2 * TOKENS)


def test_verl_r3_replay_mask_counts_only_replayed_tokens(input_ids, verl_patch):
    model = tiny_gpt_moe()
    last = NUM_LAYERS - 1
    _, routes = _record(model, input_ids)
    replay_mask = torch.ones(TOKENS, dtype=torch.bool)
    replay_mask[:4] = False  # e.g. prompt tokens: no rollout routes, verl routes them natively
    drifted = dict(routes)
    drifted[last] = _flip(routes[last], [0, 1, 2, 4, 5])  # 3 flips land on unreplayed tokens
    with RouteDriftMonitor(model) as monitor, monitor.step():
        for layer, router in find_replay_routers(model).items():
            router.router_replay.set_target_indices(drifted[layer], replay_mask)
        _set_action(find_replay_routers(model), "REPLAY_FORWARD")
        with torch.no_grad():
            forward(model, input_ids)
    _clear(model)
    metrics = monitor.metrics()
    assert metrics[f"actor/routing/flip_frac/layer_{last}"] == 2 / (TOKENS - 4)
    assert metrics["actor/routing/replayed_tokens"] == TOKENS - 4


def test_metric_keys_are_the_same_every_call(input_ids):
    model = tiny_gpt_moe()
    with RouteDriftMonitor(model) as monitor:
        empty = monitor.metrics()
        assert math.isnan(empty["actor/routing/flip_frac"]) and empty["actor/routing/replayed_tokens"] == 0
        _, routes = _record(model, input_ids)
        with monitor.step():
            _replay(model, input_ids, routes)
        _clear(model)
        assert monitor.metrics().keys() == empty.keys()
        assert len(empty) == 3 * NUM_LAYERS + 3 + 2


def test_install_is_idempotent_removable_and_absent_without_replay(input_ids):
    model = tiny_gpt_moe()
    monitor = RouteDriftMonitor.attach(model)
    assert RouteDriftMonitor.attach(model) is monitor
    with pytest.raises(RuntimeError, match="already has a RouteDriftMonitor"):
        RouteDriftMonitor(model)
    replays = [r.router_replay for r in find_replay_routers(model).values()]
    assert all("get_replay_topk" in vars(replay) for replay in replays)
    monitor.remove()
    monitor.remove()
    assert all("get_replay_topk" not in vars(replay) for replay in replays)
    assert not monitor.installed
    # Replay off: no router_replay objects, nothing to install (zero cost); asking for diagnostics is an error.
    with pytest.raises(ValueError, match="moe_enable_routing_replay=True"):
        RouteDriftMonitor(tiny_gpt_moe(moe_enable_routing_replay=False))


@pytest.mark.parametrize("path", ["native", "verl"])
def test_missing_replay_data_is_an_error_not_a_fallback(input_ids, path, request):
    if path == "verl":
        request.getfixturevalue("verl_patch")  # verl's RouterReplay alone would silently route natively here
    model = tiny_gpt_moe()
    _, routes = _record(model, input_ids)
    routes.pop(1)
    with RouteDriftMonitor(model):
        for layer, router in find_replay_routers(model).items():
            if layer in routes:
                router.router_replay.set_target_indices(routes[layer])
        _set_action(find_replay_routers(model), "REPLAY_FORWARD")
        with pytest.raises(ValueError, match=r"layer 1: REPLAY_FORWARD but no replay data .* \(12, 2\)"):
            forward(model, input_ids)
    _clear(model)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda r: r[:, :1].contiguous(), r"layer 2: replay data of shape \(12, 1\), .* expected \(12, 2\)"),
        (lambda r: r[:6], r"layer 2: replay data of shape \(6, 2\), but the router routes 12 tokens"),
        (
            lambda r: torch.full_like(r, NUM_EXPERTS),
            r"layer 2: replay data of shape \(12, 2\) holds an expert index "
            r"outside \[0, 8\)",
        ),
    ],
)
def test_bad_replay_data_names_the_layer_and_shapes(input_ids, bad, message):
    model = tiny_gpt_moe()
    _, routes = _record(model, input_ids)
    routes[2] = bad(routes[2])
    with RouteDriftMonitor(model) as monitor, pytest.raises(ValueError, match=message):
        assert not monitor.index_checked_on_host  # a monitor used directly checks indices on any device
        _replay(model, input_ids, routes)
    _clear(model)


def test_unconsumed_replay_data_fails_at_the_end_of_the_step(input_ids):
    model = tiny_gpt_moe()
    _, routes = _record(model, input_ids)
    with RouteDriftMonitor(model) as monitor:
        with pytest.raises(ValueError, match=r"unconsumed .* layer 0 \(12, 2\), layer 1 \(12, 2\), layer 2 \(12, 2\)"):
            with monitor.step():
                _set_routes(model, routes)  # set, but no forward ran
        _clear(model)
        # A recompute with nothing left to replay is an error too.
        _set_action(find_replay_routers(model), "REPLAY_BACKWARD")
        with pytest.raises(ValueError, match=r"layer 0: REPLAY_BACKWARD .* no replay data left"):
            forward(model, input_ids)
    _clear(model)
