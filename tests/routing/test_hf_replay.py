"""Routing replay on a tiny transformers Qwen3-MoE (CPU, float32): record→replay is the identity, forced experts
steer output and gradients, the diagnostics are exact on constructed drifts, and every bad input fails loudly."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from respo_verl.routing.hf import RoutingReplay, find_routers

NUM_LAYERS, NUM_EXPERTS, TOP_K = 3, 8, 2
BATCH, SEQ = 2, 6
TOKENS = BATCH * SEQ
VOCAB = 64


def tiny_qwen3_moe(norm_topk_prob: bool = True, seed: int = 0) -> Qwen3MoeForCausalLM:
    """Qwen3-30B-A3B's routing (softmax, top-k, normalised top-k probs, every layer MoE), scaled down."""
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob, decoder_sparse_step=1,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float()
    for layer in model.model.layers:  # larger router weights than the init, so routes react to perturbations
        torch.nn.init.normal_(layer.mlp.gate.weight, std=0.5)
    return model


@pytest.fixture
def model():
    return tiny_qwen3_moe()


@pytest.fixture
def input_ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _record(replay: RoutingReplay, model, input_ids):
    with torch.no_grad(), replay.record() as routes:
        logits = model(input_ids).logits
    return logits, routes


def _flip(topk_idx: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Replace the last expert of each listed token by the lowest expert outside its current set."""
    flipped = topk_idx.clone()
    for t in tokens:
        outside = [e for e in range(NUM_EXPERTS) if e not in topk_idx[t].tolist()]
        flipped[t, -1] = outside[0]
    return flipped


def test_record_then_replay_reproduces_logits_exactly(model, input_ids):
    replay = RoutingReplay(model)
    native, routes = _record(replay, model, input_ids)
    assert sorted(routes) == list(range(NUM_LAYERS))
    for topk_idx in routes.values():
        assert topk_idx.shape == (TOKENS, TOP_K) and topk_idx.dtype == torch.long
    with torch.no_grad(), replay.replay(routes):
        replayed = model(input_ids).logits
    assert torch.equal(replayed, native)
    # (batch, seq, k) routes in a compact dtype are the same routes.
    compact = {layer: idx.reshape(BATCH, SEQ, TOP_K).to(torch.uint8) for layer, idx in routes.items()}
    with torch.no_grad(), replay.replay(compact):
        assert torch.equal(model(input_ids).logits, native)
    metrics = replay.diagnostics()
    assert metrics["actor/routing/flip_frac"] == 0 and metrics["actor/routing/overlap"] == 1
    assert metrics["actor/routing/prob_mass_delta"] == 0 and metrics["actor/routing/any_layer_flip_frac"] == 0
    assert metrics["actor/routing/replayed_tokens"] == 2 * TOKENS


def test_recorded_routes_are_the_routers_top_k(model, input_ids):
    replay = RoutingReplay(model)
    with torch.no_grad(), replay.record() as routes:
        router_logits = model(input_ids, output_router_logits=True).router_logits
    for layer, logits in enumerate(router_logits):
        expected = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1).indices
        assert torch.equal(routes[layer], expected)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_gate_weights_are_the_live_softmax_on_the_replayed_experts(norm_topk_prob):
    model = tiny_qwen3_moe(norm_topk_prob)
    routers = find_routers(model)
    gen = torch.Generator().manual_seed(2)
    routes = {layer: torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
              for layer in routers}  # fmt: skip
    hidden = torch.randn(TOKENS, 32, generator=gen)
    with RoutingReplay(model) as replay, replay.replay(routes):
        for layer, router in routers.items():
            router_logits, weights, topk_idx = router(hidden)
            probs = torch.softmax(router_logits, dim=-1)
            expected = probs.gather(-1, routes[layer])
            if norm_topk_prob:
                expected = expected / expected.sum(-1, keepdim=True)
            assert torch.equal(topk_idx, routes[layer])
            torch.testing.assert_close(weights, expected, rtol=0, atol=1e-7)
            assert weights.requires_grad  # the router keeps its gradient


def test_forced_routes_change_output_and_gradient_reaches_only_selected_experts(model, input_ids):
    replay = RoutingReplay(model)
    native, routes = _record(replay, model, input_ids)
    selected = (0, 1)
    forced = {layer: torch.tensor(selected).expand(TOKENS, TOP_K) for layer in routes}
    with replay.replay(forced):
        logits = model(input_ids).logits
        logits.square().mean().backward()
    assert not torch.allclose(logits, native)
    for layer in model.model.layers:
        for param in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            grad_norm = param.grad.flatten(1).norm(dim=1)  # (num_experts,)
            assert (grad_norm[list(selected)] > 0).all()
            assert (grad_norm[len(selected) :] == 0).all()
        assert layer.mlp.gate.weight.grad.norm() > 0


def test_replay_under_gradient_checkpointing_matches_plain_backward(input_ids):
    grads = []
    for checkpointing in (False, True):
        model = tiny_qwen3_moe()
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        replay = RoutingReplay(model)
        _, routes = _record(replay, model, input_ids)
        routes = {layer: _flip(idx, list(range(0, TOKENS, 2))) for layer, idx in routes.items()}
        with replay.replay(routes):
            model(input_ids).logits.square().mean().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        assert replay.diagnostics()["actor/routing/replayed_tokens"] == TOKENS  # a recompute is not counted twice
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("flips", [0, 1, 5, TOKENS])
def test_diagnostics_are_exact_on_constructed_drift_in_the_last_layer(model, input_ids, flips):
    replay = RoutingReplay(model)
    _, routes = _record(replay, model, input_ids)
    last = NUM_LAYERS - 1
    flipped_tokens = list(range(flips))
    drifted = dict(routes)
    drifted[last] = _flip(routes[last], flipped_tokens)
    with torch.no_grad(), replay.replay(drifted):
        router_logits = model(input_ids, output_router_logits=True).router_logits
    metrics = replay.diagnostics()
    probs = torch.softmax(router_logits[last], dim=-1)
    mass_delta = (probs.gather(-1, drifted[last]).sum(-1) - probs.gather(-1, routes[last]).sum(-1)).mean().item()
    for layer in range(last):  # upstream of the drift, routes are native
        assert metrics[f"actor/routing/flip_frac/layer_{layer}"] == 0
        assert metrics[f"actor/routing/overlap/layer_{layer}"] == 1
        assert metrics[f"actor/routing/prob_mass_delta/layer_{layer}"] == 0
    assert metrics[f"actor/routing/flip_frac/layer_{last}"] == flips / TOKENS
    assert metrics[f"actor/routing/overlap/layer_{last}"] == pytest.approx(1 - flips / (TOKENS * TOP_K))
    assert metrics[f"actor/routing/prob_mass_delta/layer_{last}"] == pytest.approx(mass_delta, abs=1e-6)
    assert metrics["actor/routing/any_layer_flip_frac"] == flips / TOKENS
    assert metrics["actor/routing/flip_frac"] == pytest.approx(flips / (TOKENS * NUM_LAYERS))
    if flips:
        assert metrics[f"actor/routing/prob_mass_delta/layer_{last}"] < 0  # native top-k has the most mass


def test_diagnostics_in_the_first_layer_and_token_mask(model, input_ids):
    replay = RoutingReplay(model)
    _, routes = _record(replay, model, input_ids)
    drifted = dict(routes)
    drifted[0] = _flip(routes[0], [0, 1, 2])
    token_mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    token_mask[0, :2] = False  # two of the three flipped tokens are padding
    with torch.no_grad(), replay.replay(drifted, token_mask=token_mask):
        model(input_ids)
    metrics = replay.diagnostics()
    assert metrics["actor/routing/flip_frac/layer_0"] == 1 / (TOKENS - 2)
    assert metrics["actor/routing/replayed_tokens"] == TOKENS - 2


def test_metric_keys_are_the_same_every_call(model, input_ids):
    replay = RoutingReplay(model)
    empty = replay.diagnostics()
    assert all(k.startswith("actor/routing/") for k in empty)
    assert math.isnan(empty["actor/routing/flip_frac/layer_0"]) and empty["actor/routing/replayed_tokens"] == 0
    _, routes = _record(replay, model, input_ids)
    with torch.no_grad(), replay.replay(routes):
        model(input_ids)
    full = replay.diagnostics()
    assert full.keys() == empty.keys()
    assert len(full) == 3 * NUM_LAYERS + 3 + 2
    assert all(isinstance(v, float) for v in full.values())
    assert replay.diagnostics()["actor/routing/replayed_tokens"] == 0  # reset after reading


def test_install_is_idempotent_and_removable(model, input_ids):
    with torch.no_grad():
        native = model(input_ids).logits
    replay = RoutingReplay.attach(model)
    assert RoutingReplay.attach(model) is replay
    with pytest.raises(RuntimeError, match="already has a RoutingReplay"):
        RoutingReplay(model)
    assert all(len(router._forward_hooks) == 1 for router in replay.routers.values())
    replay.remove()
    replay.remove()
    assert all(len(router._forward_hooks) == 0 for router in replay.routers.values())
    with pytest.raises(RuntimeError, match="removed"), replay.record():
        pass
    with RoutingReplay(model) as again:
        assert again is not replay
        with torch.no_grad():
            assert torch.equal(model(input_ids).logits, native)  # hooks are pass-through outside record/replay
    assert RoutingReplay.attach(model) is not again


def test_no_router_is_an_error():
    with pytest.raises(ValueError, match=r"no MoE router .*Qwen3MoeTopKRouter"):
        RoutingReplay(torch.nn.Linear(2, 2))


def _routes(model, input_ids):
    replay = RoutingReplay(model)
    _, routes = _record(replay, model, input_ids)
    return replay, routes


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.pop(1), r"missing \[1\], unknown \[\]"),
        (lambda r: r.update({7: r[0]}), r"missing \[\], unknown \[7\]"),
        (lambda r: r.update({2: r[2][:, :1]}), r"layer 2: routes of shape \(12, 1\), expected \(tokens, 2\)"),
        (lambda r: r.update({1: r[1].float()}), "layer 1: routes must be an integer tensor"),
        (
            lambda r: r.update({0: torch.full_like(r[0], NUM_EXPERTS)}),
            r"layer 0: routes of shape \(12, 2\) hold expert indices in \[8, 8\], outside \[0, 8\)",
        ),
        (lambda r: r.update({2: r[2] - NUM_EXPERTS}), r"layer 2: .* outside \[0, 8\)"),
        (lambda r: r.update({1: r[1][:, :1].repeat(1, TOP_K)}), "layer 1: routes of shape .* repeat an expert"),
    ],
)
def test_bad_routes_fail_at_entry_naming_the_layer(model, input_ids, mutate, message):
    replay, routes = _routes(model, input_ids)
    mutate(routes)
    with pytest.raises(ValueError, match=message), replay.replay(routes):
        pytest.fail("replay() must refuse these routes")


def test_routes_for_a_different_token_count_fail_at_the_router(model, input_ids):
    replay, routes = _routes(model, input_ids)
    with pytest.raises(ValueError, match=r"layer 0: routes of shape \(12, 2\) .* sees 6 tokens .* \(6, 2\)"):
        with torch.no_grad(), replay.replay(routes):
            model(input_ids[:1])


def test_unconsumed_routes_fail_at_the_end_of_the_step(model, input_ids):
    replay, routes = _routes(model, input_ids)
    with pytest.raises(ValueError, match=r"unconsumed .* layer 0 \(12, 2\), layer 1 \(12, 2\), layer 2 \(12, 2\)"):
        with replay.replay(routes):
            pass
    # A forward that stops early leaves the later layers unconsumed.
    with pytest.raises(ValueError, match=r"unconsumed at the end of the step: layer 2 \(12, 2\)$"):
        with torch.no_grad(), replay.replay(routes):
            hidden = model.model.embed_tokens(input_ids)
            for router in list(replay.routers.values())[:2]:
                router(hidden)
    # The error of the step itself is not masked by the unconsumed check.
    with pytest.raises(KeyError), replay.replay(routes):
        raise KeyError("step failed")


def test_nested_contexts_are_refused(model, input_ids):
    replay, routes = _routes(model, input_ids)
    with replay.record(), pytest.raises(RuntimeError, match=r"cannot start replay\(\) inside an active record\(\)"):
        with replay.replay(routes):
            pass


def test_plain_training_loop_r2(model, input_ids):
    """R2 in a plain loop: record at the old-policy forward, replay in every update of the same batch."""
    replay = RoutingReplay(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.no_grad(), replay.record() as routes:
        old_logits = model(input_ids).logits
    for _ in range(3):
        with replay.replay(routes):
            logits = model(input_ids).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.flatten())
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
    metrics = replay.diagnostics()
    assert metrics["actor/routing/replayed_tokens"] == 3 * TOKENS
    assert 0 <= metrics["actor/routing/flip_frac"] <= 1 and metrics["actor/routing/prob_mass_delta"] <= 0
    assert not torch.equal(logits, old_logits)
