"""Fault injection for a CPU end-to-end test: a reward function that raises for the first response it scores.

Selected by file path as ``reward.custom_reward_function.path`` (name ``compute_score``). Each process raises once,
for its first non-empty response (the check before Ray scores an empty one); every other call is the kit's reward.
"""

from respo_verl.cpu.kit.reward import compute_score as _kit_score

RAISED = "raising_reward: the test's reward function fails for this response"
_raised = False


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    global _raised
    if solution_str and not _raised:
        _raised = True
        raise RuntimeError(RAISED)
    return _kit_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
