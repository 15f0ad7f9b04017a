"""Test-only, loaded in every Ray process of one run through ``VERL_USE_EXTERNAL_MODULES``: the agent-loop worker's
process dies when a prompt has been sampled, before it is marked finished (as one the kernel's out-of-memory killer
ends in the middle of a rollout), so the prompts it took stay "running" in verl's TransferQueue and the step's replay
buffer waits for them.

It dies at the first training prompt, or, with ``DYING_AGENT_LOOP_AFTER=K`` in the run's Ray environment, once K
training prompts have finished: with the trainer's one rollout batch per step, K = (steps before) × prompts per
step puts the death in a later step (the steps before are logged as usual).

verl's agent-loop worker marks a prompt finished through ``transfer_queue.async_kv_put`` (its class travels to the
worker by value, so its own methods cannot be replaced from here); nothing else writes that status.
"""

import os

import transfer_queue

AFTER_ENV = "DYING_AGENT_LOOP_AFTER"
_put = transfer_queue.async_kv_put
_finished = 0


async def _die_when_finished(*args, **kwargs):
    global _finished
    if (kwargs.get("tag") or {}).get("status") == "finished" and kwargs.get("partition_id") == "train":
        if _finished >= int(os.environ.get(AFTER_ENV, "0")):
            os._exit(1)
        _finished += 1
    return await _put(*args, **kwargs)


transfer_queue.async_kv_put = _die_when_finished
