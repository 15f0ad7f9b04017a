"""Markdown tables in the paper's layout and PNG plots of a comparison."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from respo_verl import algorithms
from respo_verl.tools.report.analysis import CONFIDENCE, GroupSummary, RunSummary
from respo_verl.tools.runs.stats import EARLY_WINDOW, LATE_WINDOW


def _order(algorithm: str) -> int:
    return algorithms.order(algorithm)


def _display(algorithm: str) -> str:
    return algorithms.display_name(algorithm)


def _pct(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{100.0 * x:.{digits}f}"


def late_score_table(groups: list[GroupSummary]) -> str:
    """Rows: algorithm; columns: N. Cell: late score (%) mean ± std over seeds, and Δ to VESPO in pp with CI."""
    reuses = sorted({g.reuse for g in groups})
    cells = {(g.algorithm, g.reuse): g for g in groups}
    header = "| method | " + " | ".join(f"N = {n}" for n in reuses) + " |"
    lines = [header, "|---|" + "---|" * len(reuses)]
    for algorithm in sorted({g.algorithm for g in groups}, key=_order):
        row = [_display(algorithm)]
        for n in reuses:
            g = cells.get((algorithm, n))
            if g is None:
                row.append("—")
                continue
            text = _pct(g.late_mean) + ("" if g.late_std is None else f" ± {_pct(g.late_std)}")
            text += f" (n={len(g.runs)})"
            if g.delta_pp is not None:
                ci = "" if g.delta_ci is None else f" [{g.delta_ci[0]:+.2f}, {g.delta_ci[1]:+.2f}]"
                text += f"<br>{g.delta_pp:+.2f} pp{ci}"
            row.append(text)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _short_run_note(runs: list[RunSummary]) -> str:
    """The legend's caveat when some runs are no longer than the early window: their early score is their AUC."""
    short = sum(len(r.curve) <= EARLY_WINDOW for r in runs)
    if not short:
        return ""
    which = "All runs" if short == len(runs) else f"{short} of {len(runs)} runs"
    return (
        f" {which} have at most {EARLY_WINDOW} optimizer updates: for them the early window is the whole run, "
        "so their early score is their AUC."
    )


def detail_table(groups: list[GroupSummary]) -> str:
    val_keys = sorted({k for g in groups for k in g.val})
    header = ["method", "N", "seeds", "late", "early", "AUC", "resp. length", "starved mass share", *val_keys]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for g in sorted(groups, key=lambda g: (g.reuse, _order(g.algorithm))):
        row = [
            _display(g.algorithm),
            str(g.reuse),
            ",".join(str(r.seed) for r in g.runs),
            _pct(g.late_mean),
            _pct(g.early_mean),
            _pct(g.auc_mean),
            "—" if g.length_mean is None else f"{g.length_mean:.1f}",
            _pct(g.starved_mass_mean, 1),
            *(_pct(g.val.get(k)) for k in val_keys),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _baseline_legend(groups: list[GroupSummary], runs: list[RunSummary]) -> str:
    """The legend's sentence on the difference to the baseline: said only where a baseline group exists."""
    base = _display(algorithms.BASELINE)
    with_base = sorted({g.reuse for g in groups if g.algorithm == algorithms.BASELINE})
    if not with_base:
        if any(r.algorithm == algorithms.BASELINE for r in runs):
            return f'{base}\'s runs were not averaged (see "What was not used"), so no difference to {base} is shown.'
        return f"no {base} run was found, so no difference to {base} is shown."
    text = (
        f"second line: difference to {base} at the same N in percentage points with a {int(CONFIDENCE * 100)}% "
        "Welch t interval"
    )
    without = sorted({g.reuse for g in groups} - set(with_base))
    if without:
        text += f" (no {base} group at N = {', '.join(map(str, without))}: no difference there)"
    return text + "."


def markdown_report(
    groups: list[GroupSummary],
    runs: list[RunSummary],
    refused: list[str],
    skipped: list[str],
    reward_range: str = "pm1",
) -> str:
    """The report's markdown.

    The runs of ``groups`` are the runs used; their notes (a short or incomplete run, a gap) are caveats on numbers
    that are in the tables, listed as such. "What was not used" lists only what is not in the tables: the refused
    groups (with their runs' notes), the logs left out, and the skipped lines and values.
    """
    score = "(reward + 1) / 2" if reward_range == "pm1" else "the score"
    parts = [
        "## Late training score (%)",
        "",
        f"Mean of {score} over the last {LATE_WINDOW} optimizer updates of each run; mean ± std over seeds "
        f"(n = seeds); {_baseline_legend(groups, runs)}",
        "",
        late_score_table(groups) if groups else "(no group to report)",
        "",
        "## Details",
        "",
        f"early: first {EARLY_WINDOW} optimizer updates; AUC: mean score over all optimizer updates; resp. length: "
        "mean response length over the run; starved mass share: share of the coefficient mass Σφ·|A|·tokens held by "
        "positive responses with log W < −1, mean over the run (logged by the respo/vespo losses); validation "
        "columns: last logged value." + _short_run_note(runs),
        "",
        detail_table(groups) if groups else "(none)",
    ]
    used = {r.name for g in groups for r in g.runs}
    used_notes = [f"- {r.name}: {n}" for r in runs if r.name in used for n in r.notes]
    unused_notes = [f"- {r.name}: {n}" for r in runs if r.name not in used for n in r.notes]
    if used_notes:
        parts += ["", "## Notes on the runs used", "", *used_notes]
    if refused or unused_notes or skipped:
        parts += ["", "## What was not used", ""]
        parts += [f"- {line}" for line in refused]
        parts += unused_notes
        if skipped:
            parts.append(f"- {len(skipped)} log lines or values skipped, e.g.:")
            parts += [f"  - {s}" for s in skipped[:10]]
    return "\n".join(parts) + "\n"


@dataclass(frozen=True)
class Band:
    """Mean over seeds of per-update curves, ± 1 std (std 0 where one seed covers the update)."""

    steps: list[int]  # optimizer updates 1..len
    mean: list[float]
    low: list[float]
    high: list[float]
    seeds: int


def mean_band(curves: Sequence[Sequence[float]]) -> Band:
    """Per-update mean and ± 1 std over the given curves; runs of unequal length contribute where they exist."""
    horizon = max(len(c) for c in curves)
    mean, low, high = [], [], []
    for i in range(horizon):
        values = [c[i] for c in curves if i < len(c)]
        m = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        mean.append(m)
        low.append(m - sd)
        high.append(m + sd)
    return Band(list(range(1, horizon + 1)), mean, low, high, len(curves))


def score_bands(groups: list[GroupSummary]) -> dict[tuple[str, int], Band]:
    """(algorithm, N) -> band of the score curves (fraction in [0, 1])."""
    return {(g.algorithm, g.reuse): mean_band([r.curve for r in g.runs]) for g in groups}


def starved_mass_bands(groups: list[GroupSummary]) -> dict[tuple[str, int], Band]:
    """(algorithm, N) -> band of the starved-mass-share curves, for the groups whose loss logs it."""
    bands = {}
    for g in groups:
        curves = [r.starved_mass_curve for r in g.runs if r.starved_mass_curve]
        if curves:
            bands[(g.algorithm, g.reuse)] = mean_band(curves)
    return bands


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(ax, bands: dict[tuple[str, int], Band], scale: float) -> None:
    for (algorithm, _), band in sorted(bands.items(), key=lambda kv: _order(kv[0][0])):
        color = algorithms.get(algorithm).color
        label = f"{_display(algorithm)} ({band.seeds} seed{'s' if band.seeds > 1 else ''})"
        ax.plot(band.steps, [scale * v for v in band.mean], color=color, lw=1.4, label=label)
        if band.seeds > 1:
            ax.fill_between(
                band.steps, [scale * v for v in band.low], [scale * v for v in band.high], color=color, alpha=0.2, lw=0
            )
    ax.set_xlim(1, max(b.steps[-1] for b in bands.values()))
    ax.set_xlabel("optimizer update")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


# The y-axis top of a plot whose curves are 0 throughout (%): matplotlib would centre them on ±0.055.
ZERO_PLOT_TOP = 1.0


def _start_at_zero(axes) -> None:
    """Start the y-axis of ``axes`` (one figure's, possibly shared) at 0: both plotted quantities are shares in
    [0, 100] %, and a curve that is 0 throughout would otherwise get a symmetric, partly negative axis. Called after
    every panel is drawn, so that shared axes keep the top that fits all of them."""
    highest = max(ax.dataLim.ymax for ax in axes)
    for ax in axes:
        ax.set_ylim(0.0, ax.get_ylim()[1] if highest > 0 else ZERO_PLOT_TOP)


def score_figure(groups: list[GroupSummary], reuse: int):
    """Score (%) against optimizer update for the groups at one N: mean over seeds per algorithm, ± 1 std band."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    _draw(ax, {k: b for k, b in score_bands(groups).items() if k[1] == reuse}, 100.0)
    _start_at_zero([ax])
    ax.set_ylabel("training score % (reward + 1) / 2")
    ax.set_title(f"N = {reuse}: mean over seeds, band ± 1 std")
    fig.tight_layout()
    return fig


def plot_scores(groups: list[GroupSummary], out_dir: Path) -> list[Path]:
    """One PNG per N (``score_n<N>.png``)."""
    plt = _pyplot()
    paths = []
    for reuse in sorted({g.reuse for g in groups}):
        fig = score_figure(groups, reuse)
        path = out_dir / f"score_n{reuse}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def starved_mass_figure(groups: list[GroupSummary]):
    """Starved positives' share of the coefficient mass (%) against optimizer update: one panel per N, one mean
    line per algorithm with a ± 1 std band over seeds; None when no loss logged it."""
    bands = starved_mass_bands(groups)
    if not bands:
        return None
    plt = _pyplot()
    reuses = sorted({n for _, n in bands})
    fig, axes = plt.subplots(1, len(reuses), figsize=(5 * len(reuses), 3.8), squeeze=False, sharey=True)
    for ax, reuse in zip(axes[0], reuses):
        _draw(ax, {k: b for k, b in bands.items() if k[1] == reuse}, 100.0)
        ax.set_title(f"N = {reuse}")
    _start_at_zero(axes[0])
    axes[0][0].set_ylabel("starved positives' share of\ncoefficient mass (%)")
    fig.suptitle("positive responses with log W < −1: mean over seeds, band ± 1 std", fontsize=10)
    fig.tight_layout()
    return fig


def plot_starved_mass(groups: list[GroupSummary], out_dir: Path) -> Path | None:
    """``starved_mass_share.png``, or None when no run's loss logs the share."""
    fig = starved_mass_figure(groups)
    if fig is None:
        return None
    path = out_dir / "starved_mass_share.png"
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path
