"""The comparison protocol of ``respo-verl mini``, fixed before any comparison was run.

- Every method runs the same learning-rate grid :data:`LR_GRID` at N = 32 (``--full``); the report shows each
  method at its own best learning rate (late score at N = 32) and all methods at one common learning rate chosen on
  the baselines only (:data:`BASELINES`: the mean of their late scores at N = 32), so ReSPO's own results never
  pick the rate it is compared at. N ∈ {8, 16} run at the common rate only (the budget's cut).
- Mini-batches of :data:`MINIBATCH_PROMPTS` prompts × G = 8 responses; 1024 optimizer updates per run (the paper's).
- Seeds: :data:`FULL_SEEDS` RL seeds; run s starts from warm start ``s mod 2``, so two warm starts × three RL seeds.
- Quick mode: all methods at N = 32, one seed, at :data:`QUICK_LR` (the grid's middle, fixed in advance), and
  :data:`QUICK_OPTIMIZER_STEPS` updates so that it fits a few minutes on 2 cores; it is a smoke run with the regime
  checks, not a comparison.

The late score is ``respo-verl report``'s: mean (reward + 1)/2 over the last 128 optimizer updates.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

LR_GRID = (3e-5, 1e-4, 3e-4)
QUICK_LR = 1e-4
BASELINES = ("grpo", "gspo", "vespo")
MINIBATCH_PROMPTS = 4
GROUP_SIZE = 8
OPTIMIZER_STEPS = 1024
QUICK_OPTIMIZER_STEPS = 512
GRID_REUSE = 32
FULL_REUSE = (8, 16, 32)
QUICK_REUSE = (32,)
N_WARM_STARTS = 2
FULL_SEEDS = tuple(range(3 * N_WARM_STARTS))
QUICK_SEEDS = (0,)


def warm_seed(seed: int) -> int:
    """The warm start RL seed ``seed`` starts from."""
    return seed % N_WARM_STARTS


def best_lr(late: Mapping[tuple[str, float], float], algorithm: str) -> float:
    """The learning rate of the grid with ``algorithm``'s highest mean late score (ties: the smaller rate).

    Args:
        late: (algorithm, lr) → mean late score over seeds at N = 32.
    """
    rates = sorted(lr for a, lr in late if a == algorithm)
    if not rates:
        raise ValueError(f"no late scores for {algorithm}")
    return max(rates, key=lambda lr: (late[(algorithm, lr)], -lr))


def common_lr(late: Mapping[tuple[str, float], float], baselines: tuple[str, ...] = BASELINES) -> float:
    """The learning rate with the highest mean late score over the baselines present (ReSPO plays no part)."""
    present = sorted({a for a, _ in late if a in baselines})
    if not present:
        raise ValueError(f"the common learning rate is chosen on the baselines {baselines}; none was run")
    rates = sorted({lr for a, lr in late if a in present})
    complete = [lr for lr in rates if all((a, lr) in late for a in present)]
    return max(complete, key=lambda lr: (statistics.fmean(late[(a, lr)] for a in present), -lr))
