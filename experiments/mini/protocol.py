"""The miniature's comparison protocol, fixed before any comparison was run.

- Learning rates: every method runs the grid :data:`LR_GRID` at N = 32 with :data:`GRID_SEEDS` (one RL seed per
  warm start). The grid spans the rates around the paper's regime, measured on the regime checks of all four methods
  (docs/mini.md, "Regime checks"): below it too few positives starve, above it single tokens leave the ratio band.
- The report shows each method at its own best learning rate (late score at N = 32) and all methods at one common
  learning rate, chosen on the baselines only (:data:`BASELINES`: the mean of their late scores at N = 32) among the
  grid's rates at which every method's grid runs are in the regime (:func:`regime_rates`; the regime checks measure
  the drift of the rollouts' weights, not the scores). So ReSPO's own results never pick the rate it is compared at,
  and the comparison is made where the paper's claim applies. When no rate is in the regime the common rate is
  chosen among all of them, and the summary says that the comparison cannot test the claim.
- At the common rate, the verdict's pair :data:`VERDICT` (ReSPO and VESPO) is completed at N = 32 to
  :data:`FULL_SEEDS` (two warm starts × four RL seeds) and runs N ∈ {8, 16} with :data:`GRID_SEEDS`; GRPO and GSPO
  keep the grid's two seeds (the budget's cut, docs/mini.md, "How to rerun each verdict").
- Mini-batches of :data:`MINIBATCH_PROMPTS` prompts × G = 8 responses; :data:`FULL_OPTIMIZER_STEPS` updates per run
  (the late window, the last 128, is its last four rollout batches at N = 32). The paper runs 1024; 192 updates per
  run is what fits the 45-minute budget of ``--full`` on 2 cores.
- Quick mode: all methods at N = 32, one seed, at :data:`QUICK_LR` (fixed in advance: the grid's rate at which all
  four methods were in the regime when the grid was chosen), :data:`QUICK_OPTIMIZER_STEPS` updates: a smoke run
  with the regime checks, not a comparison.

- Branch ablation (``--ablate``, added after the verdict; not part of the pre-registered comparison):
  :data:`ABLATION` at N = 32, :data:`ABLATION_LR` (the common rate the verdict's runs used), :data:`FULL_SEEDS`
  (the verdict's seeds, so each method's seed s shares warm start and RL seed with ReSPO's and VESPO's seed s).

The late score is ``respo-verl report``'s: mean (reward + 1)/2 over the last 128 optimizer updates.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the regime module imports torch; the CLI reads the protocol before it needs torch
    from experiments.mini.regime import RegimeCheck

LR_GRID = (2e-4, 3e-4, 4e-4, 5e-4)
QUICK_LR = 4e-4
BASELINES = ("grpo", "gspo", "vespo")
MINIBATCH_PROMPTS = 4
GROUP_SIZE = 8
VERDICT = ("respo", "vespo")
FULL_OPTIMIZER_STEPS = 192
QUICK_OPTIMIZER_STEPS = 192
GRID_REUSE = 32
FULL_REUSE = (8, 16, 32)
QUICK_REUSE = (32,)
N_WARM_STARTS = 2
GRID_SEEDS = tuple(range(N_WARM_STARTS))
FULL_SEEDS = tuple(range(4 * N_WARM_STARTS))
QUICK_SEEDS = (0,)
# The branch ablation: the verdict's pair, the two branch hybrids, φ ≡ 1 and GRPO without clipping.
ABLATION = ("respo", "vespo", "respo_pos", "respo_neg", "phi_one", "grpo_noclip")
# The common rate --full chose and the verdict's 16 runs used (docs/mini.md, "`--full`, measured: the verdict").
ABLATION_LR = 4e-4
# Measured wall time of one 192-update run at N = 32 on the 2-CPU AMD EPYC with another job on the machine
# (`--algos respo --seeds 0`: 109 s); the estimate printed before a named grid assumes each worker takes this long
# per 192 updates (the cost of a run is its number of updates: at every N a run samples 192/N rollout batches of
# MINIBATCH_PROMPTS·N prompts).
RUN_SECONDS_ESTIMATE = 110.0
# The paper's horizon: 1024 updates, scored on the last 128
# (docs/mini.md, "Pre-registered analysis").
HORIZON_OPTIMIZER_STEPS = 1024
TREND = ("respo", "vespo", "respo_pos")
# The second task's comparison (the pair grid) runs at the rate where its regime probe held all four checks with
# the chain task's thresholds and the high tail's, fixed before any of its runs was scored: at 4e-4 check 2 fails on
# it (docs/mini.md, "The second task: no verdict").
FORK_LR = 3e-4
# Where the pair grid at FORK_LR left no verdict (VESPO's runs short of checks 1 and 4), the rates between it and
# 4e-4 probed for one at which both methods of the verdict hold all four checks: regime only, no score
# (experiments/mini/probes/fork_rate_probe.py; docs/mini.md, "The second task: no verdict").
FORK_RATE_CANDIDATES = (3.25e-4, 3.5e-4, 3.75e-4)
FORK_RATE_PROBE_SEEDS = (0, 1)


@dataclass(frozen=True)
class Grid:
    """A named grid of ``python -m experiments.mini --grid <name>``, every run at one learning rate.

    Attributes:
        name: the ``--grid`` choice.
        cells: (algorithm, N values, RL seeds) triples.
        optimizer_steps: updates per run.
        held_out: the runs train without the held-out problems and score the final policy on them.
        about: one line for ``--help`` and the summary.
        lr: the grid's learning rate: the verdict's common rate ABLATION_LR, but FORK_LR for the second task's pair.
    """

    name: str
    cells: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    optimizer_steps: int
    held_out: bool
    about: str
    lr: float = ABLATION_LR

    def runs(self, seeds: tuple[int, ...] | None = None) -> list[tuple[str, int, float, int]]:
        """``(algorithm, N, lr, seed)`` of the grid, seed-major (the first seeds complete first); ``seeds`` keeps
        only those RL seeds."""
        keep = set(FULL_SEEDS if seeds is None else seeds)
        all_seeds = sorted({s for _, _, cell_seeds in self.cells for s in cell_seeds if s in keep})
        return [
            (algorithm, n, self.lr, s)
            for s in all_seeds
            for n in sorted({n for _, ns, _ in self.cells for n in ns})
            for algorithm, ns, cell_seeds in self.cells
            if n in ns and s in cell_seeds
        ]

    def estimate_s(self, runs: int, workers: int) -> float:
        return math.ceil(runs / workers) * RUN_SECONDS_ESTIMATE * self.optimizer_steps / FULL_OPTIMIZER_STEPS


GRIDS = {
    grid.name: grid
    for grid in (
        Grid(
            "ablate",
            tuple((a, (GRID_REUSE,), FULL_SEEDS) for a in ABLATION),
            FULL_OPTIMIZER_STEPS,
            False,
            "the branch ablation: ReSPO, VESPO, both branch hybrids, φ ≡ 1, GRPO unclipped at N = 32, 8 paired seeds",
        ),
        Grid(
            "trend",
            tuple((a, FULL_REUSE, FULL_SEEDS) for a in TREND),
            FULL_OPTIMIZER_STEPS,
            False,
            "the N trend: ReSPO, VESPO and ReSPO's positive branch at N = 8, 16, 32, 8 paired seeds",
        ),
        Grid(
            "horizon",
            (("respo", (GRID_REUSE,), FULL_SEEDS), ("vespo", (GRID_REUSE,), FULL_SEEDS),
             ("grpo", (GRID_REUSE,), FULL_SEEDS[: N_WARM_STARTS * 2])),
            HORIZON_OPTIMIZER_STEPS,
            True,
            "the paper's horizon: 1024 updates at N = 32, ReSPO and VESPO 8 seeds, GRPO 4, held-out problems scored",
        ),
        Grid(
            "pair",
            tuple((a, (GRID_REUSE,), FULL_SEEDS) for a in TREND),
            FULL_OPTIMIZER_STEPS,
            False,
            "ReSPO, VESPO and ReSPO's positive branch at N = 32, 8 paired seeds (the second task's comparison)",
            FORK_LR,
        ),
    )
}  # fmt: skip


def common_regime_rate(pooled: Mapping[tuple[str, float], RegimeCheck], algos: Sequence[str]) -> float | None:
    """The rate at which every one of ``algos`` holds its regime checks with the most room, or None where no rate
    has them all hold.

    Args:
        pooled: (algorithm, lr) -> the regime checks of its runs pooled over their seeds (``regime.RegimeCheck``).
        algos: the methods that must all be in the regime; each rate must have all of them.

    The room of a rate is the smallest :attr:`~experiments.mini.regime.RegimeCheck.margin` over ``algos``; a rate
    counts only where every one of them holds every check. Ties go to the lower rate.
    """
    rates = sorted({lr for _, lr in pooled})
    for lr in rates:
        missing = [a for a in algos if (a, lr) not in pooled]
        if missing:
            raise ValueError(f"lr {lr:g}: no pooled regime checks for {', '.join(missing)}")
    room = {lr: min(pooled[(a, lr)].margin for a in algos) for lr in rates if all(pooled[(a, lr)].holds for a in algos)}
    return max(room, key=lambda lr: (room[lr], -lr)) if room else None


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


def regime_rates(checks: Mapping[tuple[str, float], RegimeCheck]) -> list[float]:
    """The grid's learning rates at which the paper's regime holds for every method.

    Args:
        checks: (algorithm, lr) → the regime checks of that method's grid runs at that rate, pooled over its seeds
            (``regime.pool``). They measure the drift of the rollouts' weights, not the scores.
    """
    rates = sorted({lr for _, lr in checks})
    return [lr for lr in rates if all(check.holds for (_, r), check in checks.items() if r == lr)]


def common_lr(
    late: Mapping[tuple[str, float], float],
    baselines: tuple[str, ...] = BASELINES,
    eligible: list[float] | None = None,
) -> float:
    """The learning rate with the highest mean late score over the baselines present (ReSPO plays no part), among
    ``eligible`` rates when given (the rates in the regime, :func:`regime_rates`)."""
    present = sorted({a for a, _ in late if a in baselines})
    if not present:
        raise ValueError(f"the common learning rate is chosen on the baselines {baselines}; none was run")
    rates = sorted({lr for a, lr in late if a in present})
    complete = [lr for lr in rates if all((a, lr) in late for a in present) and (eligible is None or lr in eligible)]
    if not complete:
        raise ValueError(f"no learning rate of {rates} is among the eligible {eligible}")
    return max(complete, key=lambda lr: (statistics.fmean(late[(a, lr)] for a in present), -lr))


def grid_runs(algos: list[str]) -> list[tuple[str, int, float, int]]:
    """The first stage of ``--full``: ``(algorithm, N, lr, seed)`` of the learning-rate grid at N = GRID_REUSE."""
    return [(a, GRID_REUSE, lr, seed) for lr in LR_GRID for seed in GRID_SEEDS for a in algos]


def verdict_runs(algos: list[str], common: float) -> list[tuple[str, int, float, int]]:
    """The second stage of ``--full``, at the common rate: the :data:`VERDICT` pair completed to FULL_SEEDS at
    N = GRID_REUSE, and at the other N of FULL_REUSE with GRID_SEEDS."""
    pair = [a for a in algos if a in VERDICT]
    more_seeds = [s for s in FULL_SEEDS if s not in GRID_SEEDS]
    at_grid_reuse = [(a, GRID_REUSE, common, seed) for seed in more_seeds for a in pair]
    other = [(a, n, common, seed) for n in FULL_REUSE if n != GRID_REUSE for seed in GRID_SEEDS for a in pair]
    return at_grid_reuse + other
