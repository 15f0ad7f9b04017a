"""verl 0.9.1's single-turn agent loop under SAMPLE_REQUEST_IDS: with full_determinism each sample gets a request id
of its own (respo_verl/patches/verl_0_9_1.py). Run on verl's own agent loop with a stand-in server manager (the
rollout server is not needed to see which request id the loop sends); the effect on training, groups with more than
one reward, is tested end to end by tests/cpu/test_cpu_resume.py."""

from __future__ import annotations

import asyncio

import pytest

from respo_verl.patches.verl_0_9_1 import SAMPLE_REQUEST_IDS, sample_priority

PROMPT = [{"role": "user", "content": "1 2 3"}]


def test_the_priority_names_index_session_and_prompt():
    first = sample_priority(7, 0, PROMPT)
    assert first == sample_priority(7, 0, [{"role": "user", "content": "1 2 3"}])  # a fresh copy of the prompt
    others = {sample_priority(7, 1, PROMPT), sample_priority(8, 0, PROMPT), sample_priority(7, 0, [{"c": "x"}])}
    assert first not in others and len(others) == 3
    assert 0 <= first < 2**56


class _Stop(Exception):
    pass


class _ServerManager:
    def __init__(self):
        self.request_ids = []

    async def generate(self, request_id, **kwargs):
        self.request_ids.append(request_id)
        raise _Stop  # the request id is all this test needs


@pytest.fixture
def patched():
    applied = SAMPLE_REQUEST_IDS.apply()
    yield
    if applied:
        SAMPLE_REQUEST_IDS.remove()


def _request_id(session_id: int | None, **extra) -> str:
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    loop = SingleTurnAgentLoop.__new__(SingleTurnAgentLoop)  # verl's run, without building a tokenizer and server
    loop.rollout_config = type("RolloutConfig", (), {"full_determinism": True})()
    loop.server_manager = _ServerManager()

    async def process_multi_modal_info(messages):
        return {}

    async def ct_build_initial_tokens(messages, **kwargs):
        return [1, 2, 3]

    loop.process_multi_modal_info = process_multi_modal_info
    loop.ct_build_initial_tokens = ct_build_initial_tokens
    loop._get_mm_processor_kwargs = lambda audios: {}
    loop._assert_mm_supported = lambda has_mm: None
    loop.build_sglang_video_payload = lambda videos, mm_inputs: None
    kwargs = {"raw_prompt": PROMPT, "index": 7, **extra}
    if session_id is not None:
        kwargs["session_id"] = session_id
    with pytest.raises(_Stop):
        asyncio.run(SingleTurnAgentLoop.run(loop, {}, **kwargs))
    return loop.server_manager.request_ids[0]


def test_each_session_of_a_prompt_sends_its_own_request_id(patched):
    ids = [_request_id(session) for session in range(4)]
    assert len(set(ids)) == 4 and ids == [_request_id(session) for session in range(4)]
    assert ids[0] == f"det-{sample_priority(7, 0, PROMPT)}"


def test_a_priority_verl_gives_is_kept(patched):
    assert _request_id(0, priority=5) == "det-5"


def test_without_the_patch_verls_loop_sends_det_0_for_every_session():
    if SAMPLE_REQUEST_IDS.applied:
        pytest.skip("the CPU runtime of this process applied the patch")
    assert {_request_id(session) for session in range(4)} == {"det-0"}
