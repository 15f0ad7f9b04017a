"""Per-run and per-(algorithm, N) statistics in the paper's protocol (ReSPO paper, arXiv 2609.35433).

The per-run windows (late = last 128 optimizer updates, early = first 256, AUC = all) are
:mod:`respo_verl.tools.runs.stats`; here they are grouped over seeds and compared with the baseline.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from scipy import stats as scipy_stats

from respo_verl import algorithms
from respo_verl.core.diagnostics import INDEPENDENT_STARVED_MASS_KEY
from respo_verl.tools.runs.logs import LogError, RunLog, log_step, logged_reuse
from respo_verl.tools.runs.manifest import RunRecord
from respo_verl.tools.runs.stats import LATE_WINDOW, SCORE_KEY, per_update, score_curve, window_stats

LENGTH_KEY = "response_length/mean"
LR_KEY = "actor/lr"
# verl's learning-rate metric: runs of one group that log different values were configured differently.
CONFIG_SENSITIVE_KEYS = (LR_KEY,)
VAL_PATTERN = re.compile(r"^val-core/(?P<source>[^/]+)/(?P<var>acc|reward)/mean@(?P<n>\d+)$")
# The starved mass share: the share of the gradient mass Σ φ_i·|A_i|·n_tokens_i held by positive responses with
# log W < −1 (docs/method.md, "Diagnostics"), in two measures the report never mixes. INDEPENDENT: every loss in
# verl's trainer (respo_verl.verl.starvation) and in the miniature logs it under one key, with φ_i the effective
# coefficient the loss gave sequence i (read from ∂loss/∂log π_θ; respo_verl.core.diagnostics.effective_terms).
# LOSS_OWN: this package's kernel losses (respo, vespo and the kernel ablations) also log it with their own φ, under
# ``actor/<loss>/``.
INDEPENDENT = "method-independent"
LOSS_OWN = "loss's own"
STARVED_MASS_MEASURES = (INDEPENDENT, LOSS_OWN)
STARVED_MASS_PATTERN = re.compile(r"^actor/(?P<loss>[^/]+)/starved_mass_share$")
# Run names without a manifest: the package's ``<model>-respo-n32-s0[-<routing>]`` (respo_verl/run/resolvers.py,
# run_name: the presets' and the sweep's), the presets' former ``respo_n32_seed0_<model>``, and the miniature's
# ``respo_n32_lr4e-04_w0_seed0`` (experiments/mini/train.py, RunConfig.name: learning rate and warm-start seed).
# Longest names first, so that ``respo_pos_n8`` is the ablation respo_pos and not respo followed by junk.
_NAMES = sorted(algorithms.BY_NAME, key=len, reverse=True)
NAME_PATTERN = re.compile(
    rf"(?P<algorithm>{'|'.join(map(re.escape, _NAMES))})[-_]n(?P<reuse>\d+)"
    r"(?:[-_]lr(?P<lr>\d+(?:\.\d+)?(?:e[-+]?\d+)?))?(?:[-_]w(?P<warm_seed>\d+))?[-_]s(?:eed)?(?P<seed>\d+)"
)
NAME_EXAMPLES = ("respo-n32-s0", "respo_n32_seed0", "respo_n32_lr4e-04_w0_seed0")
CONFIDENCE = 0.95


@dataclass
class RunSummary:
    """One run's numbers; every curve is per optimizer update (``len(curve)`` = updates logged)."""

    name: str
    algorithm: str
    reuse: int
    seed: int
    config_hash: str | None
    log_step: str
    curve: list[float]  # (optimizer updates,) score in [0, 1]
    late: float
    early: float
    auc: float
    length: float | None
    # measure (:data:`STARVED_MASS_MEASURES`) -> (optimizer updates,) share in [0, 1], for the measures logged
    starved_mass_curves: dict[str, list[float]]
    val: dict[str, float]
    complete: bool | None
    notes: list[str] = field(default_factory=list)
    lr: float | None = None  # from the file name, when it says (the miniature's names)
    warm_seed: int | None = None
    peak_lr: float | None = None  # the largest logged ``actor/lr``, when logged

    def starved_mass(self, measure: str) -> float | None:
        """Mean of the ``measure`` curve over the run's optimizer updates; None when the log lacks it."""
        curve = self.starved_mass_curves.get(_check_measure(measure))
        return statistics.fmean(curve) if curve else None

    @property
    def cell_lr(self) -> float | None:
        """The learning rate the run's (algorithm, N, lr) cell is keyed by: the file name's, else the peak logged."""
        return self.lr if self.lr is not None else self.peak_lr


def _check_measure(measure: str) -> str:
    if measure not in STARVED_MASS_MEASURES:
        raise ValueError(f"starved mass measure {measure!r}: choose from {', '.join(STARVED_MASS_MEASURES)}")
    return measure


@dataclass
class GroupSummary:
    algorithm: str
    reuse: int
    runs: list[RunSummary]
    late_mean: float
    late_std: float | None
    early_mean: float
    auc_mean: float
    length_mean: float | None
    # measure -> (mean over the runs that log it, how many runs do); measures no run logs are absent
    starved_mass: dict[str, tuple[float, int]]
    val: dict[str, float]
    delta_pp: float | None = None  # late score minus the baseline's, percentage points
    delta_ci: tuple[float, float] | None = None


@dataclass(frozen=True)
class RunIdentity:
    """What a run is: from its manifest record, else from its log's file name (:data:`NAME_PATTERN`).

    ``lr`` and ``warm_seed`` are known only from a name that carries them (the miniature's).
    """

    algorithm: str
    reuse: int
    seed: int
    lr: float | None = None
    warm_seed: int | None = None


def parse_run_name(stem: str) -> RunIdentity | None:
    """The run a log file name (without ``.jsonl``) describes, or None when it does not say (:data:`NAME_PATTERN`)."""
    match = NAME_PATTERN.search(stem)
    if match is None:
        return None
    return RunIdentity(
        algorithm=match["algorithm"],
        reuse=int(match["reuse"]),
        seed=int(match["seed"]),
        lr=None if match["lr"] is None else float(match["lr"]),
        warm_seed=None if match["warm_seed"] is None else int(match["warm_seed"]),
    )


def identify(run: RunLog, record: RunRecord | None) -> RunIdentity:
    """The run's identity from the manifest record, else from the log's file name."""
    if record is not None:
        return RunIdentity(record.algorithm, record.reuse, record.seed)
    identity = parse_run_name(run.path.stem)
    if identity is None:
        raise ValueError(
            f"{run.path}: no manifest entry and the file name does not say the run's algorithm, N and seed "
            f"(expected a name containing e.g. {' or '.join(repr(n) for n in NAME_EXAMPLES)})"
        )
    return identity


def _last(series: dict[int, float]) -> float | None:
    return series[max(series)] if series else None


def summarise_run(
    run: RunLog, record: RunRecord | None, score_key: str = SCORE_KEY, reward_range: str = "pm1"
) -> RunSummary:
    """Summarise one log.

    Raises:
        ValueError: the run cannot be identified (no manifest record, no parsable name).
        LogError: the log contradicts the manifest or itself (step unit, N), or a score lies outside
            ``reward_range``.
        KeyError: ``score_key`` is not in the log.
    """
    identity = identify(run, record)
    algorithm, reuse, seed = identity.algorithm, identity.reuse, identity.seed
    unit = log_step(run, record.log_step if record is not None else None)
    logged = logged_reuse(run)
    if logged is not None and logged != reuse:
        source = "manifest" if record is not None else "file name"
        raise LogError(f"{run.path}: the {source} says N = {reuse}, the log says N = {logged}")
    curve, notes = score_curve(run, reuse, unit, score_key, reward_range)
    notes += [f"log: {note}" for note in run.continuity]
    complete = None
    if record is not None:
        complete = run.complete_through(record.last_log_step)
        if not complete:
            logged = sum(1 for step in run.steps if 1 <= step <= record.last_log_step)
            notes.append(f"incomplete: {logged} of {record.last_log_step} {unit} steps logged")
    windows = window_stats(curve)
    if windows.updates < LATE_WINDOW:
        notes.append(f"only {windows.updates} optimizer steps: the late window covers the whole run")
    lengths = run.series(LENGTH_KEY)
    starved_keys = {INDEPENDENT: [INDEPENDENT_STARVED_MASS_KEY] if run.series(INDEPENDENT_STARVED_MASS_KEY) else []}
    own_key = f"actor/{algorithm}/starved_mass_share"  # first when several losses log one
    starved_keys[LOSS_OWN] = sorted(
        (k for k in run.metrics if STARVED_MASS_PATTERN.match(k) and run.series(k)), key=lambda k: (k != own_key, k)
    )
    if len(starved_keys[LOSS_OWN]) > 1:
        notes.append(
            f"several losses log a starved mass share ({', '.join(starved_keys[LOSS_OWN])}): the loss's own measure "
            f"is {starved_keys[LOSS_OWN][0]}'s"
        )
    starved_curves = {
        measure: per_update(run.series(keys[0]), reuse, unit)[0] for measure, keys in starved_keys.items() if keys
    }
    lrs = run.series(LR_KEY)
    val = {}
    for key, series in run.metrics.items():
        match = VAL_PATTERN.match(key)
        if match:
            val[f"{match['source']}/{match['var']}@{match['n']}"] = _last(series)
    return RunSummary(
        name=record.name if record else run.path.stem,
        algorithm=algorithm,
        reuse=reuse,
        seed=seed,
        config_hash=record.config_hash if record else None,
        log_step=unit,
        curve=curve,
        late=windows.late,
        early=windows.early,
        auc=windows.auc,
        length=statistics.fmean(per_update(lengths, reuse, unit)[0]) if lengths else None,
        starved_mass_curves=starved_curves,
        val=val,
        complete=complete,
        notes=notes,
        lr=identity.lr,
        warm_seed=identity.warm_seed,
        peak_lr=max(lrs.values()) if lrs else None,
    )


def check_group_consistency(runs: list[RunSummary], logs: dict[str, RunLog]) -> list[str]:
    """Reasons why the runs of one (algorithm, N) group must not be averaged; empty when they may."""
    problems = []
    hashes = {r.config_hash for r in runs if r.config_hash is not None}
    if len(hashes) > 1:
        by_hash = defaultdict(list)
        for r in runs:
            by_hash[r.config_hash].append(r.name)
        problems.append("different configurations (manifest config_hash): " + "; ".join(
            f"{h[:12]}: {', '.join(names)}" for h, names in by_hash.items()
        ))  # fmt: skip
    for key in CONFIG_SENSITIVE_KEYS:
        first_values = {r.name: logs[r.name].series(key) for r in runs if logs[r.name].series(key)}
        shared = set.intersection(*(set(s) for s in first_values.values())) if len(first_values) > 1 else set()
        for step in sorted(shared)[:1]:
            values = {name: s[step] for name, s in first_values.items()}
            if len(set(values.values())) > 1:
                problems.append(f"{key} differs at step {step}: {values}")
    named_lrs = {r.name: r.lr for r in runs if r.lr is not None}
    if len(set(named_lrs.values())) > 1:
        problems.append(f"learning rates differ (file names): {named_lrs}")
    seeds = [r.seed for r in runs]
    if len(seeds) != len(set(seeds)):
        problems.append(f"seeds repeat within the group: {sorted(seeds)}")
    return problems


def _mean_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _starved_mass_means(runs: list[RunSummary]) -> dict[str, tuple[float, int]]:
    means = {}
    for measure in STARVED_MASS_MEASURES:
        values = [v for r in runs if (v := r.starved_mass(measure)) is not None]
        if values:
            means[measure] = (statistics.fmean(values), len(values))
    return means


def welch_interval(a: list[float], b: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Welch's t confidence interval for mean(a) − mean(b); None with fewer than two values on either side."""
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.fmean(a) - statistics.fmean(b)
    se = math.sqrt(va + vb)
    if se == 0.0:
        return (diff, diff)
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2, dof)) * se
    return (diff - half, diff + half)


def summarise_groups(runs: list[RunSummary], logs: dict[str, RunLog]) -> tuple[list[GroupSummary], list[str]]:
    """Group runs by (algorithm, N); returns the groups and the groups refused as mixed (with reasons)."""
    grouped: dict[tuple[str, int], list[RunSummary]] = defaultdict(list)
    for r in runs:
        grouped[(r.algorithm, r.reuse)].append(r)
    groups, refused = [], []
    for (algorithm, reuse), members in sorted(grouped.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        problems = check_group_consistency(members, logs)
        if problems:
            refused.append(f"{algorithm} N={reuse}: not averaged — " + "; ".join(problems))
            continue
        lates = [r.late for r in members]
        vals = defaultdict(list)
        for r in members:
            for k, v in r.val.items():
                vals[k].append(v)
        groups.append(
            GroupSummary(
                algorithm=algorithm,
                reuse=reuse,
                runs=sorted(members, key=lambda r: r.seed),
                late_mean=statistics.fmean(lates),
                late_std=statistics.stdev(lates) if len(lates) > 1 else None,
                early_mean=statistics.fmean(r.early for r in members),
                auc_mean=statistics.fmean(r.auc for r in members),
                length_mean=_mean_or_none([r.length for r in members]),
                starved_mass=_starved_mass_means(members),
                val={k: statistics.fmean(v) for k, v in vals.items()},
            )
        )
    baseline = {g.reuse: g for g in groups if g.algorithm == algorithms.BASELINE}
    for g in groups:
        base = baseline.get(g.reuse)
        if base is None or g is base:
            continue
        g.delta_pp = 100.0 * (g.late_mean - base.late_mean)
        ci = welch_interval([r.late for r in g.runs], [r.late for r in base.runs])
        g.delta_ci = None if ci is None else (100.0 * ci[0], 100.0 * ci[1])
    return groups, refused


@dataclass(frozen=True)
class GapPoint:
    """One (algorithm, N, lr) cell against the baseline's cell at the same N and lr; means over seeds.

    ``starved_mass`` is the :data:`INDEPENDENT` measure: each run's mean over all its optimizer updates, then the
    mean over the cell's seeds; ``baseline_starved_mass`` the same for the baseline's cell (None when one of its runs
    lacks it).
    """

    algorithm: str
    reuse: int
    lr: float | None  # the cell's learning rate (:attr:`RunSummary.cell_lr`); None when no run says it
    starved_mass: float  # share in [0, 1]
    gap_pp: float  # mean late score minus the baseline's, percentage points
    seeds: int
    baseline_seeds: int
    baseline_starved_mass: float | None = None


def format_lr(lr: float | None) -> str:
    return "lr not logged" if lr is None else f"lr {lr:g}"


def _cell_name(algorithm: str, reuse: int, lr: float | None) -> str:
    return f"{algorithm} N={reuse}, {format_lr(lr)}"


def gap_points(runs: list[RunSummary], logs: dict[str, RunLog]) -> tuple[list[GapPoint], list[str]]:
    """Late-score gap to the baseline against the method-independent starved mass, per (algorithm, N, lr) cell.

    Every identified run counts, also those of an (algorithm, N) group refused for mixing learning rates: here the
    learning rate is part of the cell. A cell is a point when it and the baseline's cell at its N and lr hold runs
    that may be averaged (:func:`check_group_consistency`) and each of its runs logs
    :data:`INDEPENDENT_STARVED_MASS_KEY`.

    Returns:
        The points, in table order, and one line for each cell of another algorithm that is not a point, with why.
    """
    cells: dict[tuple[str, int, float | None], list[RunSummary]] = defaultdict(list)
    for r in runs:
        cells[(r.algorithm, r.reuse, r.cell_lr)].append(r)
    problems = {key: check_group_consistency(members, logs) for key, members in cells.items()}
    points, left_out = [], []
    for key in sorted(cells, key=lambda k: (algorithms.order(k[0]), k[1], -math.inf if k[2] is None else k[2])):
        algorithm, reuse, lr = key
        if algorithm == algorithms.BASELINE:
            continue
        members, base_key = cells[key], (algorithms.BASELINE, reuse, lr)
        name, base = _cell_name(*key), algorithms.display_name(algorithms.BASELINE)
        if problems[key]:
            left_out.append(f"{name}: not averaged — " + "; ".join(problems[key]))
            continue
        if base_key not in cells:
            left_out.append(f"{name}: no {base} run at N={reuse}, {format_lr(lr)}")
            continue
        if problems[base_key]:
            left_out.append(f"{name}: {base}'s runs at N={reuse}, {format_lr(lr)} are not averaged")
            continue
        masses = [r.starved_mass(INDEPENDENT) for r in members]
        if None in masses:
            missing = sorted(r.name for r, m in zip(members, masses) if m is None)
            left_out.append(f"{name}: {', '.join(missing)} log no {INDEPENDENT_STARVED_MASS_KEY}")
            continue
        base_runs = cells[base_key]
        base_masses = [r.starved_mass(INDEPENDENT) for r in base_runs]
        gap = statistics.fmean(r.late for r in members) - statistics.fmean(r.late for r in base_runs)
        points.append(
            GapPoint(
                algorithm=algorithm,
                reuse=reuse,
                lr=lr,
                starved_mass=statistics.fmean(masses),
                gap_pp=100.0 * gap,
                seeds=len(members),
                baseline_seeds=len(base_runs),
                baseline_starved_mass=None if None in base_masses else statistics.fmean(base_masses),
            )
        )
    return points, left_out
