"""Fault for the R3 guard: verl's vLLM server hands back all-zero ``routed_experts``, as vLLM's CPU MoE kernel did
before respo-verl's patch fed its top-k to vLLM's capture hook (right shape, every entry 0).

Loaded in every Ray process of one test run through ``VERL_USE_EXTERNAL_MODULES`` (after the CPU runtime's switch);
only the rollout server's process ever calls the wrapped method.
"""

import functools

import numpy as np
from verl.workers.rollout.vllm_rollout import vllm_async_server

_server = vllm_async_server.vLLMHttpServer
_generate = _server.generate


@functools.wraps(_generate)
async def generate(self, *args, **kwargs):
    output = await _generate(self, *args, **kwargs)
    if output.routed_experts is not None:
        output.routed_experts = np.zeros_like(output.routed_experts)
    return output


_server.generate = generate
