"""Fault injection for a CPU end-to-end test: a reward function that raises for the first response it scores.

Selected by file path as ``reward.custom_reward_function.path`` (name ``compute_score``). Each process raises once,
for its first non-empty response (the check before Ray scores an empty one); every other call is the kit's reward.
With ``RAISING_REWARD_AFTER=<log>@<k>`` in the run's Ray environment it raises only once verl's file log ``<log>``
holds k steps, i.e. in step k + 1 (tests/support/cpu_runs.py, ``after_steps``). With ``RAISING_REWARD_INDEX=<i>`` it
raises only for a response to the prompt whose ``extra_info`` index is i: which group fails then does not depend on
the order in which the responses reach the reward (verl replaces the failed group with a fresh prompt, so a run
compared with another to the last bit needs the same group to fail in both).
"""

import os
from pathlib import Path

from respo_verl.cpu.kit.reward import compute_score as _kit_score

RAISED = "raising_reward: the test's reward function fails for this response"
AFTER_ENV = "RAISING_REWARD_AFTER"
INDEX_ENV = "RAISING_REWARD_INDEX"
_raised = False


def _armed() -> bool:
    log, _, steps = os.environ.get(AFTER_ENV, "").rpartition("@")
    if not log:
        return True
    path = Path(log)
    logged = path.read_text().count('"step"') if path.is_file() else 0
    return logged >= int(steps)


def _chosen(extra_info) -> bool:
    index = os.environ.get(INDEX_ENV)
    return index is None or (extra_info or {}).get("index") == int(index)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    global _raised
    if solution_str and not _raised and _armed() and _chosen(extra_info):
        _raised = True
        raise RuntimeError(RAISED)
    return _kit_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
