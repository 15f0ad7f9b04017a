"""R3's routes under ROUTES_UINT8 (respo_verl/patches/verl_0_9_1_routes.py), on verl 0.9.1's own agent-loop output
and TransferQueue batching: vLLM's uint8 stays uint8 and every other field is verl's. That the packed uint8 routes
reach megatron-core's routers as int64 on the device is tests/routing/test_route_drift_layouts.py; the real run with
verl's vLLM server is tests/cpu/test_cpu_vllm.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from respo_verl.patches.verl_0_9_1_routes import ROUTES_UINT8, aligned_routes

LAYERS, TOP_K = 3, 2


@pytest.fixture
def patched():
    applied = ROUTES_UINT8.apply()
    yield
    if applied:
        ROUTES_UINT8.remove()


def _output(routes):
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    return AgentLoopOutput(
        prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11], response_mask=[1, 1, 1, 1],
        response_logprobs=[-0.5] * 4, routed_experts=routes, metrics=AgentLoopMetrics(),
    )  # fmt: skip


def _vllm_routes(dtype=np.uint8) -> np.ndarray:
    """vLLM's routes of prompt + response - 1 tokens, read-only as Ray hands them over."""
    routes = np.arange(6 * LAYERS * TOP_K, dtype=dtype).reshape(6, LAYERS, TOP_K) % 128
    routes.flags.writeable = False
    return routes


def test_uint8_routes_stay_uint8_and_every_other_field_is_verls(patched):
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    routes = _vllm_routes()
    out = _output(routes).as_dict()
    verls = vars(AgentLoopOutput)["as_dict"].__wrapped__(_output(routes))  # verl's own
    assert out["routed_experts"].dtype == torch.uint8 and verls["routed_experts"].dtype == torch.int16
    assert out["routed_experts"].shape == (7, LAYERS, TOP_K)  # the sample's own length, prompt + response
    assert torch.equal(out["routed_experts"].to(torch.int16), verls["routed_experts"])
    assert not out["routed_experts"][-1].any()  # vLLM has no route for the last token
    assert out.keys() == verls.keys()
    for key in out.keys() - {"routed_experts", "metrics", "extra_fields"}:
        assert torch.equal(out[key], verls[key]) if torch.is_tensor(out[key]) else out[key] == verls[key], key


def test_other_dtypes_take_verls_path_and_remove_restores_it():
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    was_applied = ROUTES_UINT8.remove()  # the plugin applies it with the route-drift engines
    original = vars(AgentLoopOutput)["as_dict"]
    assert ROUTES_UINT8.apply()
    try:
        wide = _output(_vllm_routes(np.uint16)).as_dict()  # vLLM above 256 experts
        assert wide["routed_experts"].dtype == torch.int16
        assert "routed_experts" not in _output(None).as_dict()
    finally:
        ROUTES_UINT8.remove()
        assert vars(AgentLoopOutput)["as_dict"] is original
        if was_applied:
            ROUTES_UINT8.apply()


def test_the_transfer_queue_batches_them_as_jagged_uint8(patched):
    """What verl's TransferQueue agent loop puts (agent_loop_tq.py: list_of_dict_to_tensordict of as_dict's fields):
    one jagged uint8 tensor, each sample at its own length, one byte per expert id."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    short = _output(_vllm_routes()[:4])
    short.response_ids, short.response_mask, short.response_logprobs = [8, 9], [1, 1], [-0.5] * 2
    batch = list_of_dict_to_tensordict(
        [{"routed_experts": o.as_dict()["routed_experts"]} for o in (_output(_vllm_routes()), short)]
    )
    routes = batch["routed_experts"]
    assert routes.is_nested and routes.dtype == torch.uint8
    assert routes.offsets().diff().tolist() == [7, 5]
    assert routes.values().nbytes == (7 + 5) * LAYERS * TOP_K


def test_aligned_routes_cut_at_the_sample_and_keep_the_dtype():
    routes = torch.ones(5, LAYERS, TOP_K, dtype=torch.uint8)
    assert aligned_routes(routes, 3).shape == (3, LAYERS, TOP_K)
    padded = aligned_routes(routes.numpy(), 6)
    assert padded.dtype == torch.uint8 and padded[:5].all() and not padded[5].any()
