"""Markdown tables in the paper's layout and PNG plots of a comparison."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from respo_verl import algorithms
from respo_verl.tools.report.analysis import (
    CONFIDENCE,
    INDEPENDENT,
    INDEPENDENT_STARVED_MASS_KEY,
    LOSS_OWN,
    ROUTING_DISPLAY,
    ROUTING_OFF,
    ROUTINGS,
    STARVED_MASS_MEASURES,
    GapPoint,
    GroupKey,
    GroupSummary,
    ReplayDifference,
    RunSummary,
    Variants,
    format_lr,
    key_order,
    replay_differences,
)
from respo_verl.tools.report.routing import FLIP, ROUTING_PLOT, ROUTING_PLOT_LEGEND, GroupRouting
from respo_verl.tools.runs.stats import EARLY_WINDOW, LATE_WINDOW


def _pct(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{100.0 * x:.{digits}f}"


def _late_cell(g: GroupSummary) -> str:
    """Late score (%) mean ± std over seeds, the number of seeds and of partial runs among them."""
    text = _pct(g.late_mean) + ("" if g.late_std is None else f" ± {_pct(g.late_std)}")
    partial = _partial(g.runs)
    return text + f" (n={len(g.runs)}" + (f", {len(partial)} partial" if partial else "") + ")"


def _difference(delta_pp: float, ci: tuple[float, float] | None) -> str:
    return f"{delta_pp:+.2f} pp" + ("" if ci is None else f" [{ci[0]:+.2f}, {ci[1]:+.2f}]")


def late_score_table(groups: list[GroupSummary]) -> str:
    """Rows: algorithm (and model and routing replay mode where they vary, :class:`Variants`); columns: N.
    Cell: late score (%) mean ± std over seeds, and Δ to VESPO in pp with CI."""
    variants = Variants.of(g.key for g in groups)
    reuses = sorted({g.reuse for g in groups})
    cells = {g.key: g for g in groups}
    rows = sorted({g.key._replace(reuse=0) for g in groups}, key=key_order)  # one row per key up to N
    header = ["method", *variants.headers(), *(f"N = {n}" for n in reuses)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row_key in rows:
        row = [algorithms.display_name(row_key.algorithm), *variants.cells(row_key)]
        for n in reuses:
            g = cells.get(row_key._replace(reuse=n))
            if g is None:
                row.append("—")
                continue
            text = _late_cell(g)
            if g.delta_pp is not None:
                text += f"<br>{_difference(g.delta_pp, g.delta_ci)}"
            row.append(text)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _partial(runs: list[RunSummary]) -> list[RunSummary]:
    """The runs whose log ends before the manifest's planned last step (a run still running, stopped or failed)."""
    return [r for r in runs if r.complete is False]


def _seeds_cell(runs: list[RunSummary]) -> str:
    partial = [str(r.seed) for r in _partial(runs)]
    return ",".join(str(r.seed) for r in runs) + (f" (partial: {','.join(partial)})" if partial else "")


def _partial_legend(runs: list[RunSummary]) -> str:
    partial = _partial(runs)
    if not partial:
        return ""
    return (
        f" Partial ({', '.join(r.name for r in partial)}): the log ends before the run's planned last step (the run "
        "is still running, was stopped or failed); its numbers are over the steps it logged (Notes on the runs used)."
    )


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


# The detail table's header for each starved mass measure: which measure a number is, in every column name.
STARVED_MASS_COLUMNS = {INDEPENDENT: "starved mass (method-independent)", LOSS_OWN: "starved mass (loss's own φ)"}
# One plot file per starved mass measure, so that a file name says which measure its curves are.
STARVED_MASS_PLOTS = {INDEPENDENT: "starved_mass_share.png", LOSS_OWN: "starved_mass_share_loss.png"}
GAP_PLOT = "gap_vs_starved_mass.png"


def _starved_cell(g: GroupSummary, measure: str) -> str:
    if measure not in g.starved_mass:
        return "—"
    mean, logged = g.starved_mass[measure]
    return _pct(mean, 1) + ("" if logged == len(g.runs) else f" ({logged} of {len(g.runs)} runs)")


def detail_table(groups: list[GroupSummary]) -> str:
    variants = Variants.of(g.key for g in groups)
    val_keys = sorted({k for g in groups for k in g.val})
    starved = [STARVED_MASS_COLUMNS[m] for m in STARVED_MASS_MEASURES]
    header = ["method", *variants.headers(), "N", "seeds", "late", *starved, "early", "AUC", "resp. length", *val_keys]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for g in sorted(groups, key=lambda g: key_order(g.key)):
        row = [
            algorithms.display_name(g.algorithm),
            *variants.cells(g.key),
            str(g.reuse),
            _seeds_cell(g.runs),
            _pct(g.late_mean),
            *(_starved_cell(g, m) for m in STARVED_MASS_MEASURES),
            _pct(g.early_mean),
            _pct(g.auc_mean),
            "—" if g.length_mean is None else f"{g.length_mean:.1f}",
            *(_pct(g.val.get(k)) for k in val_keys),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


STARVED_MASS_LEGEND = (
    "starved mass: the share of the gradient mass Σ φ·|A|·tokens held by positive responses with log W < −1 (%), "
    'mean over the run\'s optimizer updates, mean over the seeds that log it ("k of n runs" when not all do), in '
    f"two measures kept in separate columns: {STARVED_MASS_COLUMNS[INDEPENDENT]} is `{INDEPENDENT_STARVED_MASS_KEY}`, "
    "logged for every loss (in verl's trainer and in the miniature) with φ the effective coefficient the loss gave "
    f"each sequence (read from its gradient); {STARVED_MASS_COLUMNS[LOSS_OWN]} is "
    "`actor/<loss>/starved_mass_share`, logged by the kernel losses (respo, vespo and the kernel ablations) with "
    "their own φ"
)


def _baseline_legend(groups: list[GroupSummary], runs: list[RunSummary]) -> str:
    """The legend's sentence on the difference to the baseline: said only where a baseline group exists."""
    base = algorithms.display_name(algorithms.BASELINE)
    variants = Variants.of(g.key for g in groups)
    # Where a difference can be taken: a baseline group of the same N, model and routing mode (its key with N = 0).
    with_base = {g.key for g in groups if g.algorithm == algorithms.BASELINE}
    if not with_base:
        if any(r.algorithm == algorithms.BASELINE for r in runs):
            return f'{base}\'s runs were not averaged (see "What was not used"), so no difference to {base} is shown.'
        return f"no {base} run was found, so no difference to {base} is shown."
    shared = ["N", *(["model"] * variants.model), *(["routing"] * variants.routing)]
    same = "the same " + (shared[0] if len(shared) == 1 else ", ".join(shared[:-1]) + " and " + shared[-1])
    text = (
        f"second line: difference to {base} at {same} in percentage points with a {int(CONFIDENCE * 100)}% "
        "Welch t interval"
    )
    without = sorted({g.key._replace(algorithm=algorithms.BASELINE) for g in groups} - with_base, key=key_order)
    if without:
        where = ", ".join(f"{k.reuse}{variants.tag(k)}" for k in without)
        text += f" (no {base} group at N = {where}: no difference there)"
    return text + "."


def gap_table(points: list[GapPoint]) -> str:
    variants = Variants.of(p.key for p in points)
    base = algorithms.display_name(algorithms.BASELINE)
    mass = STARVED_MASS_COLUMNS[INDEPENDENT]
    header = ["method", *variants.headers(), "N", "lr", f"{mass} (%)", f"gap to {base} (pp)", f"{base}'s {mass} (%)"]
    header.append("seeds")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for p in points:
        cells = [algorithms.display_name(p.algorithm), *variants.cells(p.key), str(p.reuse)]
        cells.append(format_lr(p.lr).removeprefix("lr "))
        cells += [_pct(p.starved_mass, 1), f"{p.gap_pp:+.2f}", _pct(p.baseline_starved_mass, 1)]
        cells.append(f"{p.seeds} / {p.baseline_seeds} ({base})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gap_section(points: list[GapPoint], left_out: list[str], runs: list[RunSummary]) -> list[str]:
    """The markdown of the late-score gap against the method-independent starved mass (:func:`gap_points`)."""
    base = algorithms.display_name(algorithms.BASELINE)
    parts = ["## Late-score gap against starved mass", ""]
    if not any(r.algorithm == algorithms.BASELINE for r in runs):
        return [*parts, f"No {base} run was found, so there is no gap to {base} to plot against starved mass."]
    parts.append(
        f"One point per (method, N, learning rate) with a {base} run at the same N and learning rate: the "
        f"method-independent starved mass share (`{INDEPENDENT_STARVED_MASS_KEY}`; each run's mean over all its "
        f"optimizer updates, mean over seeds) and the method's late score minus {base}'s (means over seeds), in "
        f"`{GAP_PLOT}` when plots are written; beside them {base}'s own share in that cell. The learning rate is the "
        "file name's, else the largest logged `actor/lr`."
        + _kept_apart(Variants.of(r.key for r in runs), f"a cell is compared with {base}'s of the same {{same}}")
    )
    parts += ["", gap_table(points) if points else "(no point)"]
    if left_out:
        parts += ["", "Not in the plot:", "", *(f"- {line}" for line in left_out)]
    return parts


def _kept_apart(variants: Variants, how: str) -> str:
    """The legend's sentence saying that runs of different models or replay modes are not averaged together, ``how``
    (with ``{same}``: what they share) saying how they are shown; '' when the runs do not differ in them."""
    differ = [*(["model"] * variants.model), *(["routing replay mode"] * variants.routing)]
    if not differ:
        return ""
    plural = " or ".join(f"{d}s" for d in differ)
    return f" Runs of different {plural} are never averaged together: {how.format(same=' and '.join(differ))}."


REPLAY_LEGEND = (
    "Late score with routing replay minus the late score without it (routing off), for the same model, method and N: "
    "each side's mean ± std over seeds (n = seeds), and the difference of the means in percentage points with a "
    f"{int(CONFIDENCE * 100)}% Welch t interval, as the difference to {algorithms.display_name(algorithms.BASELINE)} "
    "in the table above. R2 replays the routes of the trainer's old-log-prob forward in every update on the rollout "
    "batch, R3 the rollout engine's routes in every training forward (docs/routing-replay.md)."
)


def replay_table(differences: list[ReplayDifference], variants: Variants) -> str:
    """One row per (method, model, N, replay mode): both sides' late scores and the difference; a model column where
    the report's runs are of several models (``variants``)."""
    header = ["method", *(["model"] * variants.model), "N", "replay", "late, off (%)", "late, replay (%)"]
    header.append("replay − off")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for d in differences:
        key = d.replay.key
        cells = [algorithms.display_name(key.algorithm), *([key.model or "—"] * variants.model), str(key.reuse)]
        cells += [ROUTING_DISPLAY[key.routing], _late_cell(d.off), _late_cell(d.replay)]
        cells.append(_difference(d.delta_pp, d.delta_ci))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replay_section(differences: list[ReplayDifference], left_out: list[str], variants: Variants) -> list[str]:
    """The report's "Routing replay" section (:func:`~respo_verl.tools.report.analysis.replay_differences`)."""
    parts = ["## Routing replay", "", REPLAY_LEGEND, ""]
    no_pair = "(no method has runs both with and without replay)"
    parts.append(replay_table(differences, variants) if differences else no_pair)
    if left_out:
        parts += ["", "Not compared:", "", *(f"- {line}" for line in left_out)]
    return parts


# What each plot shows, for the report's list of the files it wrote.
PLOT_LEGENDS = {
    STARVED_MASS_PLOTS[INDEPENDENT]: "the method-independent starved mass share against optimizer update, per N",
    STARVED_MASS_PLOTS[LOSS_OWN]: "the loss's own starved mass share against optimizer update, per N",
    GAP_PLOT: f"late-score gap to {algorithms.display_name(algorithms.BASELINE)} against the method-independent "
    "starved mass share, per (method, N, learning rate)",
    ROUTING_PLOT: ROUTING_PLOT_LEGEND,
}


def _plot_legend(name: str) -> str:
    if name.startswith("score_n"):
        return "training score against optimizer update, mean over seeds with a ± 1 std band"
    return PLOT_LEGENDS[name]


def plots_section(names: Sequence[str]) -> str:
    """The report's list of the plot files written (``names``), each with what it shows; '' without plots."""
    if not names:
        return ""
    return "\n## Plots\n\n" + "".join(f"- `{name}`: {_plot_legend(name)}\n" for name in names)


def markdown_report(
    groups: list[GroupSummary],
    runs: list[RunSummary],
    refused: list[str],
    skipped: list[str],
    reward_range: str = "pm1",
    gap: tuple[list[GapPoint], list[str]] = ([], []),
) -> str:
    """The report's markdown.

    The runs of ``groups`` are the runs used; their notes (a short or incomplete run, a gap) are caveats on numbers
    that are in the tables, listed as such. "What was not used" lists only what is not in the tables: the refused
    groups (with their runs' notes), the logs left out, and the skipped lines and values. ``gap`` is
    :func:`~respo_verl.tools.report.analysis.gap_points`'s answer. Where some run replays routing, a "Routing
    replay" section follows the late-score table (:func:`replay_section`).
    """
    score = "(reward + 1) / 2" if reward_range == "pm1" else "the score"
    parts = [
        "## Late training score (%)",
        "",
        f"Mean of {score} over the last {LATE_WINDOW} optimizer updates of each run; mean ± std over seeds "
        f"(n = seeds); {_baseline_legend(groups, runs)}{_partial_legend([r for g in groups for r in g.runs])}"
        + _kept_apart(Variants.of(r.key for r in runs), "each has its own row"),
        "",
        late_score_table(groups) if groups else "(no group to report)",
        "",
    ]
    if any(r.routing != ROUTING_OFF for r in runs):
        parts += [*replay_section(*replay_differences(groups, runs), Variants.of(r.key for r in runs)), ""]
    parts += [
        "## Details",
        "",
        f"{STARVED_MASS_LEGEND}; early: first {EARLY_WINDOW} optimizer updates; AUC: mean score over all optimizer "
        "updates; resp. length: mean response length over the run; validation columns: last logged value."
        + _short_run_note(runs),
        "",
        detail_table(groups) if groups else "(none)",
        "",
        *gap_section(*gap, runs),
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


def score_bands(groups: list[GroupSummary]) -> dict[GroupKey, Band]:
    """The group's key -> band of the score curves (fraction in [0, 1])."""
    return {g.key: mean_band([r.curve for r in g.runs]) for g in groups}


def starved_mass_bands(groups: list[GroupSummary], measure: str) -> dict[GroupKey, Band]:
    """The group's key -> band of the ``measure`` starved-mass-share curves, for the groups whose runs log it."""
    bands = {}
    for g in groups:
        curves = [c for r in g.runs if (c := r.starved_mass_curves.get(measure))]
        if curves:
            bands[g.key] = mean_band(curves)
    return bands


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path | None:
    """Write ``fig`` to ``path`` and close it; None (nothing written) when there is no figure."""
    if fig is None:
        return None
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


# Line styles of a plot's (model, routing replay mode) variants, in their table order: an algorithm keeps its colour,
# and its R3 line is told from its line without replay by the style.
LINESTYLES = ("-", "--", ":", "-.")


def _variant_styles(keys) -> dict[tuple[str | None, str], str]:
    """(model, routing) -> line style, for the variants among ``keys``."""
    variants = sorted({(k.model, k.routing) for k in keys}, key=lambda v: (v[0] or "", ROUTINGS.index(v[1])))
    return {v: LINESTYLES[i % len(LINESTYLES)] for i, v in enumerate(variants)}


def _draw(ax, bands: dict[GroupKey, Band], scale: float, keys: list[GroupKey]) -> None:
    """One mean line per group (colour: its algorithm; style: its model and routing mode), ± 1 std band; ``keys``
    are the figure's groups', so that a variant has one style and one label in all its panels."""
    variants, styles = Variants.of(keys), _variant_styles(keys)
    for key, band in sorted(bands.items(), key=lambda kv: (algorithms.order(kv[0].algorithm), key_order(kv[0]))):
        color = algorithms.get(key.algorithm).color
        seeds = f"{band.seeds} seed{'s' if band.seeds > 1 else ''}"
        label = ", ".join([algorithms.display_name(key.algorithm), *variants.parts(key)]) + f" ({seeds})"
        style = styles[(key.model, key.routing)]
        ax.plot(band.steps, [scale * v for v in band.mean], color=color, ls=style, lw=1.4, label=label)
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
    """Start the y-axis of ``axes`` (one figure's, possibly shared) at 0: every plotted quantity is a share in
    [0, 100] %, and a curve that is 0 throughout would otherwise get a symmetric, partly negative axis. Called after
    every panel is drawn, so that shared axes keep the top that fits all of them."""
    highest = max(ax.dataLim.ymax for ax in axes)
    for ax in axes:
        ax.set_ylim(0.0, ax.get_ylim()[1] if highest > 0 else ZERO_PLOT_TOP)


def score_figure(groups: list[GroupSummary], reuse: int):
    """Score (%) against optimizer update for the groups at one N: mean over seeds per group, ± 1 std band."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    _draw(ax, {k: b for k, b in score_bands(groups).items() if k.reuse == reuse}, 100.0, [g.key for g in groups])
    _start_at_zero([ax])
    ax.set_ylabel("training score % (reward + 1) / 2")
    ax.set_title(f"N = {reuse}: mean over seeds, band ± 1 std")
    fig.tight_layout()
    return fig


STARVED_MASS_TITLES = {
    INDEPENDENT: f"method-independent ({INDEPENDENT_STARVED_MASS_KEY}, φ = effective coefficient)",
    LOSS_OWN: "the loss's own (actor/<loss>/starved_mass_share, φ = its kernel)",
}


def starved_mass_figure(groups: list[GroupSummary], measure: str):
    """Starved positives' share of the gradient mass (%) in ``measure`` against optimizer update: one panel per N,
    one mean line per group with a ± 1 std band over seeds; None when no run logs that measure."""
    bands = starved_mass_bands(groups, measure)
    if not bands:
        return None
    plt = _pyplot()
    reuses = sorted({k.reuse for k in bands})
    fig, axes = plt.subplots(1, len(reuses), figsize=(5 * len(reuses), 3.8), squeeze=False, sharey=True)
    for ax, reuse in zip(axes[0], reuses):
        _draw(ax, {k: b for k, b in bands.items() if k.reuse == reuse}, 100.0, [g.key for g in groups])
        ax.set_title(f"N = {reuse}")
    _start_at_zero(axes[0])
    axes[0][0].set_ylabel("starved positives' share of\ngradient mass (%)")
    fig.suptitle(
        f"positive responses with log W < −1: mean over seeds, band ± 1 std\n{STARVED_MASS_TITLES[measure]}",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


# Marker shapes by algorithm, in table order: a point's algorithm is legible without colour.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def gap_figure(points: list[GapPoint]):
    """Late-score gap to the baseline (pp) against the method-independent starved mass share (%): one marker per
    algorithm, each point annotated with its N and learning rate (and model and routing mode where they vary); None
    without points."""
    if not points:
        return None
    variants = Variants.of(p.key for p in points)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algorithm in sorted({p.algorithm for p in points}, key=algorithms.order):
        mine = [p for p in points if p.algorithm == algorithm]
        ax.scatter(
            [100.0 * p.starved_mass for p in mine],
            [p.gap_pp for p in mine],
            color=algorithms.get(algorithm).color,
            marker=MARKERS[algorithms.order(algorithm) % len(MARKERS)],
            label=algorithms.display_name(algorithm),
            zorder=3,
        )
        for p in mine:
            ax.annotate(
                ", ".join([f"N={p.reuse}", format_lr(p.lr), *variants.parts(p.key)]),
                (100.0 * p.starved_mass, p.gap_pp),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
    base = algorithms.display_name(algorithms.BASELINE)
    ax.axhline(0.0, color="black", lw=0.8, alpha=0.6)
    ax.set_xlabel(
        f"method-independent starved mass share (%) ({INDEPENDENT_STARVED_MASS_KEY}),\n"
        "mean over the run, mean over seeds"
    )
    ax.set_ylabel(f"late score − {base}'s (pp), means over seeds")
    ax.set_title(f"gap to {base} at the same N and learning rate", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def routing_figure(groups: list[GroupRouting]):
    """Flip share (%) against j: one panel per algorithm, one line per N (and model and routing mode, by line style;
    a bucket at its middle index); None when no group has per-update values."""
    curves = [g for g in groups if g.by_update.get(FLIP)]
    if not curves:
        return None
    plt = _pyplot()
    methods = sorted({g.algorithm for g in curves}, key=algorithms.order)
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 3.8), squeeze=False, sharey=True)
    reuses = sorted({g.reuse for g in curves})
    cmap = plt.get_cmap("viridis")
    keys = [g.key for g in curves]
    variants, styles = Variants.of(keys), _variant_styles(keys)
    for ax, algorithm in zip(axes[0], methods):
        for g in (g for g in curves if g.algorithm == algorithm):
            spans = sorted(g.by_update[FLIP])
            xs = [(lo + hi) / 2 for lo, hi in spans]
            ys = [100.0 * g.by_update[FLIP][s] for s in spans]
            color = cmap(reuses.index(g.reuse) / max(1, len(reuses) - 1) * 0.85)
            seeds = len([r for r in g.runs if FLIP in r.by_update])
            label = ", ".join([f"N = {g.reuse}", *variants.parts(g.key)]) + f" ({seeds} seed{'s' * (seeds > 1)})"
            ax.plot(xs, ys, marker="o", ms=3, lw=1.4, color=color, ls=styles[(g.model, g.routing)], label=label)
        ax.set_title(algorithms.display_name(algorithm))
        ax.set_xlabel("update index j on the rollout batch (R2: j updates stale)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _start_at_zero(axes[0])
    axes[0][0].set_ylabel("route flip share (%)\n(token, layer) pairs, late in the run")
    fig.tight_layout()
    return fig


def write_plots(
    groups: list[GroupSummary], points: list[GapPoint], routing: list[GroupRouting], out_dir: Path
) -> list[Path]:
    """The report's plots that have something to show, written to ``out_dir`` (:data:`PLOT_LEGENDS`)."""
    paths = [_save(score_figure(groups, n), out_dir / f"score_n{n}.png") for n in sorted({g.reuse for g in groups})]
    paths += [_save(starved_mass_figure(groups, m), out_dir / STARVED_MASS_PLOTS[m]) for m in STARVED_MASS_MEASURES]
    paths += [_save(gap_figure(points), out_dir / GAP_PLOT), _save(routing_figure(routing), out_dir / ROUTING_PLOT)]
    return [path for path in paths if path is not None]
