"""Fault injection for a CPU end-to-end test: a reward function that never returns (a verifier that hangs).

Selected by file path as ``reward.custom_reward_function.path`` (name ``compute_score``). Every call for a non-empty
response (the check before Ray scores an empty one) blocks its thread for good, so no sample of the step finishes,
while every process stays alive and answers Ray; the first one says so.
"""

import threading

from respo_verl.cpu.kit.reward import compute_score as _kit_score

STALLED = "stalling_reward: the test's reward function never returns"
_said = threading.Event()
_never = threading.Event()


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if not solution_str:
        return _kit_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if not _said.is_set():
        _said.set()
        print(STALLED, flush=True)
    _never.wait()
    raise AssertionError("unreachable: the stalled reward was released")
