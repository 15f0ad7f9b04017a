"""Route drift in the report: how far the replayed experts are from the live router's, by update index j.

Under routing replay (R2) the j-th update on a rollout batch replays routes recorded j updates earlier, so the drift
should grow with j (docs/routing-replay.md). Two kinds of logs carry it:

- verl's trainer (one line per training step) with the route-drift engine: ``actor/routing/by_update/<label>/...``
  per update index, ``<label>`` = ``j<j>`` or a bucket ``j<lo>-<hi>``
  (:func:`respo_verl.routing.diagnostics.update_label`), next to the step's mean over its N updates;
- the miniature (one line per optimizer update): ``actor/routing/...`` of that update, whose j is
  ``(step − 1) mod N`` (its loop runs N updates per rollout batch, in order).

Each run's values are means over its late steps: the training steps of the report's late window (the last
``LATE_WINDOW`` optimizer updates, at least one step), or the whole run when it is shorter. Runs are then averaged
over seeds within a group of the report (algorithm, N, model, routing replay mode:
:class:`~respo_verl.tools.report.analysis.GroupKey`), so that R2's drift and R3's are never averaged together.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from respo_verl import algorithms
from respo_verl.routing.diagnostics import BY_UPDATE, parse_update_label
from respo_verl.tools.report.analysis import ROUTING_OFF, GroupKey, Variants, key_order
from respo_verl.tools.runs.logs import RunLog
from respo_verl.tools.runs.stats import LATE_WINDOW

PREFIX = "actor/routing"
FLIP, OVERLAP, ANY_LAYER = "flip_frac", "overlap", "any_layer_flip_frac"
METRICS = (FLIP, OVERLAP, ANY_LAYER)
ROUTING_PLOT = "routing_flip_by_update.png"
ROUTING_PLOT_LEGEND = (
    "route flip share (replayed expert set ≠ the live router's, share of (token, layer) pairs, %) against the "
    "update index j on a rollout batch, late in the run: one panel per method, one line per N, mean over seeds"
)


@dataclass
class RunRouting:
    """One run's route drift late in the run.

    Attributes:
        by_update: metric -> {(lo, hi) update indices: mean over the late steps}; empty when the log has no per-j
            values.
        overall: metric -> mean over the late steps of the per-step (all-updates) value.
        late_steps: how many logged steps (lines) the means are over.
    """

    name: str
    algorithm: str
    reuse: int
    seed: int
    by_update: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    overall: dict[str, float] = field(default_factory=dict)
    late_steps: int = 0
    model: str | None = None
    routing: str = ROUTING_OFF

    @property
    def key(self) -> GroupKey:
        return GroupKey(self.algorithm, self.reuse, self.model, self.routing)


def _late(series: dict[int, float], steps: int) -> list[float]:
    return [series[s] for s in sorted(series)[-steps:]]


def run_routing(
    name: str,
    algorithm: str,
    reuse: int,
    seed: int,
    log_step: str,
    log: RunLog,
    model: str | None = None,
    routing: str = ROUTING_OFF,
) -> RunRouting | None:
    """The run's route drift, or None when its log has no ``actor/routing/...`` metric.

    Args:
        log_step: what a line of ``log`` counts, ``training`` (verl) or ``optimizer`` (the miniature).
        model, routing: the run's model and routing replay mode (:class:`~respo_verl.tools.report.analysis.GroupKey`).
    """
    if not any(key.startswith(PREFIX + "/") for key in log.metrics):
        return None
    per_update_log = log_step == "optimizer"
    late = LATE_WINDOW if per_update_log else max(1, LATE_WINDOW // reuse)  # lines in the late window
    out = RunRouting(name, algorithm, reuse, seed, model=model, routing=routing)
    for metric in METRICS:
        series = log.series(f"{PREFIX}/{metric}")
        if series:
            values = _late(series, late)
            out.overall[metric] = statistics.fmean(values)
            out.late_steps = max(out.late_steps, len(values))
        if per_update_log and series:
            by_j: dict[tuple[int, int], list[float]] = defaultdict(list)
            for step in sorted(series)[-late:]:
                j = (step - 1) % reuse
                by_j[(j, j)].append(series[step])
            out.by_update[metric] = {span: statistics.fmean(v) for span, v in sorted(by_j.items())}
    if not per_update_log:
        head = f"{PREFIX}/{BY_UPDATE}/"
        for key, series in log.metrics.items():
            if not key.startswith(head) or not series:
                continue
            label, _, metric = key[len(head) :].partition("/")
            span = parse_update_label(label)
            if span is None or metric not in METRICS:
                continue
            out.by_update.setdefault(metric, {})[span] = statistics.fmean(_late(series, late))
        out.by_update = {m: dict(sorted(v.items())) for m, v in out.by_update.items()}
    return out


@dataclass
class GroupRouting:
    """Route drift of one group (:class:`~respo_verl.tools.report.analysis.GroupKey`): per-run values averaged over
    the runs that have them."""

    algorithm: str
    reuse: int
    runs: list[RunRouting]
    by_update: dict[str, dict[tuple[int, int], float]]
    overall: dict[str, float]
    model: str | None = None
    routing: str = ROUTING_OFF

    @property
    def key(self) -> GroupKey:
        return GroupKey(self.algorithm, self.reuse, self.model, self.routing)

    def at(self, metric: str, which: str) -> float | None:
        """``metric`` at the first (``first``) or last (``last``) update index logged; None when not logged."""
        curve = self.by_update.get(metric)
        if not curve:
            return None
        return curve[min(curve)] if which == "first" else curve[max(curve)]

    def last_label(self) -> str | None:
        curve = self.by_update.get(FLIP)
        if not curve:
            return None
        lo, hi = max(curve)
        return f"{lo}" if lo == hi else f"{lo}–{hi}"


def _mean_of(dicts: list[dict]) -> dict:
    keys = sorted({k for d in dicts for k in d})
    return {k: statistics.fmean(d[k] for d in dicts if k in d) for k in keys}


def group_routing(runs: Sequence[RunRouting]) -> list[GroupRouting]:
    """Group by :class:`~respo_verl.tools.report.analysis.GroupKey`, in the report's order (N, model, the algorithms'
    table order, routing mode)."""
    grouped: dict[GroupKey, list[RunRouting]] = defaultdict(list)
    for r in runs:
        grouped[r.key].append(r)
    groups = []
    for key, members in sorted(grouped.items(), key=lambda kv: key_order(kv[0])):
        metrics = sorted({m for r in members for m in r.by_update})
        by_update = {m: _mean_of([r.by_update[m] for r in members if m in r.by_update]) for m in metrics}
        overall = _mean_of([r.overall for r in members])
        members = sorted(members, key=lambda r: r.seed)
        groups.append(GroupRouting(key.algorithm, key.reuse, members, by_update, overall, key.model, key.routing))
    return groups


def _cell(x: float | None, percent: bool = True) -> str:
    if x is None or math.isnan(x):
        return "—"
    return f"{100.0 * x:.2f}" if percent else f"{x:.4f}"


def routing_section(groups: list[GroupRouting], without: Sequence[str], replayed: bool = False) -> list[str]:
    """The report's "Route drift" section: one row per group; ``without`` names the runs that logged no
    routing metric. Empty when no run logged one (then the report says so in one line, which says whether some of
    the runs replayed routing: ``replayed``)."""
    if not groups:
        why = "those with routing replay included" if replayed else "routing replay off"
        return ["## Route drift", "", f"No run logged routing metrics (`actor/routing/...`: {why}).", ""]
    variants = Variants.of(g.key for g in groups)
    lines = [
        "## Route drift",
        "",
        f"Routing replay: the replayed expert sets against the live router's own top-k, late in each run (the steps "
        f"of the last {LATE_WINDOW} optimizer updates, or the whole run when shorter), mean over seeds. flip: share "
        "of (token, layer) pairs whose expert set differs (%); j: the update's index on its rollout batch, so under "
        "R2 its routes are j updates stale; overlap: mean |replayed ∩ live| / k over all updates; any-layer flip: "
        "share of tokens flipped in at least one layer (%), at the last j and over all updates.",
        "",
        "| "
        + " | ".join(["method", *variants.headers(), "N", "seeds", "late steps"])
        + " | flip, j = 0 | flip, last j | last j | flip, all j | overlap, all j "
        "| any-layer flip, last j | any-layer flip, all j |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(variants.headers()),
    ]
    for g in groups:
        seeds = ",".join(str(r.seed) for r in g.runs)
        steps = ",".join(str(r.late_steps) for r in g.runs)
        first = g.by_update.get(FLIP, {}).get((0, 0))
        ident = " | ".join([algorithms.display_name(g.algorithm), *variants.cells(g.key), str(g.reuse)])
        lines.append(
            f"| {ident} | {seeds} | {steps} | {_cell(first)} "
            f"| {_cell(g.at(FLIP, 'last'))} | {g.last_label() or '—'} | {_cell(g.overall.get(FLIP))} "
            f"| {_cell(g.overall.get(OVERLAP), percent=False)} | {_cell(g.at(ANY_LAYER, 'last'))} "
            f"| {_cell(g.overall.get(ANY_LAYER))} |"
        )
    no_j = [
        f"{algorithms.display_name(g.algorithm)} N={g.reuse}{variants.tag(g.key)}"
        for g in groups
        if FLIP not in g.by_update
    ]
    if no_j:
        lines += ["", f"No per-update values (logs from before `by_update` keys): {', '.join(no_j)}."]
    if without:
        lines += ["", f"No routing metrics in: {', '.join(sorted(without))}."]
    return [*lines, ""]
