"""For a CPU end-to-end test that kills its run's reward worker: the kit's reward, which says once per process in
which process it scores (the RewardLoopWorker's; verl's naive reward manager calls it in a thread of that process).

Selected by file path as ``reward.custom_reward_function.path`` (name ``compute_score``).
"""

import os

from respo_verl.cpu.kit.reward import compute_score as _kit_score

ANNOUNCED = "announcing_reward: scoring in pid"
_announced = False


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    global _announced
    if not _announced:
        _announced = True
        print(f"{ANNOUNCED} {os.getpid()}", flush=True)
    return _kit_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
