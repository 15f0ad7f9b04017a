"""The paper's statistics of one run, per optimizer update (ReSPO paper, arXiv 2609.35433, experimental protocol).

verl logs the mean sequence score of each rollout batch (``critic/score/mean``, a ±1 reward in the paper) once per
training step, and one training step is N optimizer updates that all trained on that batch; a per-update log
(the miniature) has one line per update already. :func:`per_update` puts both on the optimizer-update axis,
so that every window below is counted in optimizer updates whatever the log's unit:

- late score: mean over the last :data:`LATE_WINDOW` (128) updates, the paper's headline metric;
- early score: mean over the first :data:`EARLY_WINDOW` (256) updates;
- AUC: mean over all updates (area under the score curve divided by its length).

The paper reports the score as (reward + 1) / 2; :func:`score_curve` converts from the declared reward range and
refuses a value outside it instead of printing a percentage below 0 or above 100.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

from respo_verl.protocol import PAPER_LATE_WINDOW
from respo_verl.tools.runs.logs import LOG_STEPS, LogError, RunLog

SCORE_KEY = "critic/score/mean"
# Window sizes, in optimizer updates: the paper's late window, and the early window of the learning-speed AUC.
LATE_WINDOW = PAPER_LATE_WINDOW
EARLY_WINDOW = 256
# --reward-range choices: the interval the logged score lies in.
REWARD_RANGES = {"pm1": (-1.0, 1.0), "01": (0.0, 1.0)}


class ScoreRangeError(LogError):
    """A logged score outside the declared reward range."""


def per_update(series: dict[int, float], reuse: int, log_step: str) -> tuple[list[float], list[int]]:
    """One value per optimizer update from a logged series, and the logged steps after a gap.

    Args:
        series: logged step -> value.
        reuse: N, optimizer updates per training step.
        log_step: ``training`` (each value covers N updates) or ``optimizer`` (one update each).

    Returns:
        ``(values, gaps)``: the per-update values in step order (missing steps are left out, so the curve joins
        the logged steps) and the first step after each gap.
    """
    if log_step not in LOG_STEPS:
        raise ValueError(f"log_step must be one of {LOG_STEPS}, got {log_step!r}")
    if reuse < 1:
        raise ValueError(f"N must be >= 1, got {reuse}")
    steps = sorted(series)
    gaps = [b for a, b in itertools.pairwise(steps) if b != a + 1]
    repeat = reuse if log_step == "training" else 1
    return [series[s] for s in steps for _ in range(repeat)], gaps


def score_curve(
    run: RunLog, reuse: int, log_step: str, score_key: str = SCORE_KEY, reward_range: str = "pm1"
) -> tuple[list[float], list[str]]:
    """Per-optimizer-update score in [0, 1], and notes on gaps.

    Raises:
        KeyError: ``score_key`` is not in the log.
        ScoreRangeError: a logged value lies outside ``reward_range``.
    """
    if reward_range not in REWARD_RANGES:
        raise ValueError(f"reward_range must be one of {sorted(REWARD_RANGES)}, got {reward_range!r}")
    series = run.series(score_key)
    if not series:
        raise KeyError(score_key)
    low, high = REWARD_RANGES[reward_range]
    outside = [(s, v) for s, v in sorted(series.items()) if not low <= v <= high]
    if outside:
        step, value = outside[0]
        raise ScoreRangeError(
            f"{run.path}: {score_key} = {value:g} at step {step} lies outside the declared reward range "
            f"[{low:g}, {high:g}] (--reward-range {reward_range}; {len(outside)} value(s) outside)"
        )
    values, gaps = per_update(series, reuse, log_step)
    notes = []
    if gaps:
        notes.append(f"{log_step} steps missing before {gaps[:5]} in {score_key}; the curve joins the logged steps")
    if reward_range == "pm1":
        values = [(r + 1.0) / 2.0 for r in values]
    return values, notes


@dataclass(frozen=True)
class WindowStats:
    """Late, early and AUC score of one curve (see the module docstring); ``updates`` is the curve's length."""

    late: float
    early: float
    auc: float
    updates: int


def window_stats(curve: list[float], late_window: int = LATE_WINDOW, early_window: int = EARLY_WINDOW) -> WindowStats:
    """The windows of one per-update curve; a curve shorter than a window is averaged whole."""
    if not curve:
        raise ValueError("empty score curve")
    return WindowStats(
        late=statistics.fmean(curve[-late_window:]),
        early=statistics.fmean(curve[:early_window]),
        auc=statistics.fmean(curve),
        updates=len(curve),
    )
