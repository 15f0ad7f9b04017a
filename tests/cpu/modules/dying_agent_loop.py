"""Test-only, loaded in every Ray process of one run through ``VERL_USE_EXTERNAL_MODULES``: the agent-loop worker's
process dies when its first prompt has been sampled, before it is marked finished (as one the kernel's
out-of-memory killer ends in the middle of a rollout), so the prompts it took stay "running" in verl's TransferQueue
and the step's replay buffer waits for them.

verl's agent-loop worker marks a prompt finished through ``transfer_queue.async_kv_put`` (its class travels to the
worker by value, so its own methods cannot be replaced from here); nothing else writes that status.
"""

import os

import transfer_queue

_put = transfer_queue.async_kv_put


async def _die_when_finished(*args, **kwargs):
    if (kwargs.get("tag") or {}).get("status") == "finished":
        os._exit(1)
    return await _put(*args, **kwargs)


transfer_queue.async_kv_put = _die_when_finished
