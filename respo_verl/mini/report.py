"""Summary of ``respo-verl mini`` runs: the Markdown table and the score plot, from the records each run logged.

The comparison report across runs (late score in the paper's window, deltas to VESPO) is ``respo-verl report``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The paper's "late score" is the mean over the last 128 of 1024 optimizer steps; with shorter runs we use the same
# share of the run on both ends: the first and the last quarter of the optimizer steps.
WINDOW_SHARE = 0.25
ALGORITHM_ORDER = ("grpo", "gspo", "vespo", "respo")
COLORS = {"grpo": "tab:blue", "gspo": "tab:green", "vespo": "tab:orange", "respo": "tab:red"}


def _window(values: Sequence[float], where: str) -> list[float]:
    n = max(1, math.ceil(WINDOW_SHARE * len(values)))
    return list(values[:n] if where == "early" else values[-n:])


def _nanmean(values: Iterable[float | None]) -> float:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(kept) if kept else math.nan


@dataclass
class RunSummary:
    """The numbers one run contributes to the table.

    Attributes:
        early, late: mean score (reward+1)/2 over the first / last quarter of optimizer steps.
        starved_frac, starved_mass: SPEC §4 starvation share (of responses / of gradient mass), averaged over the
            stale half of every rollout batch (mini-batches j ≥ N/2), where reuse has moved the policy.
        pos_log_w_p10: 10th percentile of log W of positive responses, same mini-batches.
        wall_s: run time.
    """

    algorithm: str
    reuse: int
    seed: int
    early: float
    late: float
    starved_frac: float
    starved_mass: float
    pos_log_w_p10: float
    wall_s: float


def summarize_run(algorithm: str, reuse: int, seed: int, records: list[dict[str, Any]]) -> RunSummary:
    data = [r["data"] for r in records]
    scores = [d["mini/score"] for d in data]
    stale = [d for d in data if d["mini/minibatch"] >= reuse // 2]
    return RunSummary(
        algorithm,
        reuse,
        seed,
        statistics.fmean(_window(scores, "early")),
        statistics.fmean(_window(scores, "late")),
        _nanmean(d["mini/diag/starved_frac"] for d in stale),
        _nanmean(d["mini/diag/starved_mass_share"] for d in stale),
        _nanmean(d["mini/diag/pos/log_w_p10"] if d["mini/diag/pos/frac"] > 0 else None for d in stale),
        data[-1]["mini/wall_time_s"] if data else 0.0,
    )


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error over the seeds that have a value (NaN: the statistic was undefined in that run)."""
    present = [v for v in values if not math.isnan(v)]
    if not present:
        return math.nan, math.nan
    mean = statistics.fmean(present)
    se = statistics.stdev(present) / math.sqrt(len(present)) if len(present) > 1 else math.nan
    return mean, se


def _fmt(mean: float, se: float, scale: float = 100.0, digits: int = 1) -> str:
    if math.isnan(mean):
        return "–"
    if math.isnan(se):
        return f"{mean * scale:.{digits}f}"
    return f"{mean * scale:.{digits}f} ± {se * scale:.{digits}f}"


def _order(algorithm: str) -> int:
    return ALGORITHM_ORDER.index(algorithm) if algorithm in ALGORITHM_ORDER else len(ALGORITHM_ORDER)


def markdown_table(runs: Sequence[RunSummary]) -> str:
    """One row per (algorithm, N): scores in % (mean ± standard error over seeds; no ± with one seed)."""
    keys = sorted({(r.reuse, r.algorithm) for r in runs}, key=lambda k: (k[0], _order(k[1])))
    lines = [
        "| algorithm | N | seeds | early score % | late score % | starved responses % | starved gradient mass % "
        "| positive log W p10 | run time s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for reuse, algorithm in keys:
        group = [r for r in runs if r.algorithm == algorithm and r.reuse == reuse]
        cells = [
            _fmt(*_mean_se([r.early for r in group])),
            _fmt(*_mean_se([r.late for r in group])),
            _fmt(*_mean_se([r.starved_frac for r in group])),
            _fmt(*_mean_se([r.starved_mass for r in group])),
            _fmt(*_mean_se([r.pos_log_w_p10 for r in group]), scale=1.0, digits=2),
            f"{statistics.fmean(r.wall_s for r in group):.0f}",
        ]
        lines.append(f"| {algorithm} | {reuse} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_scores(series: dict[tuple[str, int], list[list[float]]], path: Path, title: str) -> Path:
    """Score against optimizer step: one panel per N, one line per algorithm (mean over seeds), ± SE band.

    Args:
        series: (algorithm, N) → per-seed score series (one value per optimizer step).
        path: PNG to write.
        title: figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reuses = sorted({n for _, n in series})
    fig, axes = plt.subplots(1, len(reuses), figsize=(5.2 * len(reuses), 3.8), squeeze=False, sharey=True)
    for ax, reuse in zip(axes[0], reuses):
        for algorithm in sorted({a for a, n in series if n == reuse}, key=_order):
            runs = series[(algorithm, reuse)]
            length = min(len(s) for s in runs)
            steps = list(range(1, length + 1))
            mean = [statistics.fmean(s[i] for s in runs) for i in range(length)]
            color = COLORS.get(algorithm)
            ax.plot(
                steps,
                [100 * m for m in mean],
                label=f"{algorithm} ({len(runs)} seed{'s' if len(runs) > 1 else ''})",
                color=color,
                lw=1.4,
            )
            if len(runs) > 1:
                se = [statistics.stdev(s[i] for s in runs) / math.sqrt(len(runs)) for i in range(length)]
                lo = [100 * (m - e) for m, e in zip(mean, se)]
                hi = [100 * (m + e) for m, e in zip(mean, se)]
                ax.fill_between(steps, lo, hi, color=color, alpha=0.2, lw=0)
        ax.set_title(f"N = {reuse}")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training score % (reward+1)/2")
    axes[0][-1].legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
