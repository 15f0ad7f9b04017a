"""Per-run and per-group statistics in the paper's protocol (ReSPO paper, arXiv 2609.35433).

The per-run windows (late = last 128 optimizer updates, early = first 256, AUC = all) are
:mod:`respo_verl.tools.runs.stats`; here they are grouped over seeds and compared with the baseline. A group is one
(algorithm, N, model, routing replay mode): runs of different models or replay modes are never averaged together, and
routing replay is compared with its absence at the same model, algorithm and N (:func:`replay_differences`).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from scipy import stats as scipy_stats

from respo_verl import algorithms
from respo_verl.core.diagnostics import INDEPENDENT_STARVED_MASS_KEY
from respo_verl.routing.mode import REPLAY_MODES
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
# Routing replay's modes (respo_verl/routing/mode.py) in table order: off first, the side replay is compared with.
ROUTING_OFF = "off"
ROUTINGS = REPLAY_MODES
REPLAYED = tuple(mode for mode in ROUTINGS if mode != ROUTING_OFF)
ROUTING_DISPLAY = {"off": "off", "r2": "R2", "r3": "R3"}  # the paper's and verl's spelling of the replay modes
_REPLAY_TAG = "|".join(map(re.escape, REPLAYED))
# What a name says of routing replay after its seed: the package's ``-r2``/``-r3`` (absent: off), the miniature's
# ``_r2`` (before ``_ho`` on a held-out run), and the presets' former ``_<model folder>[_<routing>]``.
ROUTING_AFTER_SEED = re.compile(rf"[-_](?P<routing>{_REPLAY_TAG})(?=$|[-_])")
FORMER_PRESET_TAIL = re.compile(rf"_(?P<model>.+?)(?:_(?P<routing>{_REPLAY_TAG}))?")


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
    model: str | None = None  # :attr:`RunIdentity.model`
    routing: str = ROUTING_OFF  # :attr:`RunIdentity.routing`

    @property
    def key(self) -> GroupKey:
        """The group the run is averaged in."""
        return GroupKey(self.algorithm, self.reuse, self.model, self.routing)

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


class GroupKey(NamedTuple):
    """What the runs of one group share: runs that differ in any of it are never averaged together."""

    algorithm: str
    reuse: int
    model: str | None  # None: the run's name does not say
    routing: str  # one of :data:`ROUTINGS`


def key_order(key: GroupKey) -> tuple:
    """Sort key of group keys in the tables' order: N, model, the algorithms' table order, then off, R2, R3 (so that
    the replay modes of one method and N stand side by side)."""
    return (key.reuse, key.model or "", algorithms.order(key.algorithm), ROUTINGS.index(key.routing))


@dataclass(frozen=True)
class Variants:
    """Which of a report's identity columns its tables show: the model where runs of several models are reported,
    the routing replay mode where some run replays routing. Neither in the common case (one model, replay off), where
    the tables look as they did before runs had a model and a routing mode."""

    model: bool
    routing: bool

    @classmethod
    def of(cls, keys: Iterable[GroupKey]) -> Variants:
        keys = list(keys)
        return cls(model=len({k.model for k in keys}) > 1, routing=any(k.routing != ROUTING_OFF for k in keys))

    def headers(self) -> list[str]:
        return ["model"] * self.model + ["routing"] * self.routing

    def cells(self, key: GroupKey) -> list[str]:
        """The key's cells under :meth:`headers`."""
        return [key.model or "—"] * self.model + [ROUTING_DISPLAY[key.routing]] * self.routing

    def parts(self, key: GroupKey) -> list[str]:
        """The key's model and routing mode as words, those of them that are shown."""
        return [key.model or "model not named"] * self.model + [ROUTING_DISPLAY[key.routing]] * self.routing

    def tag(self, key: GroupKey) -> str:
        """`` (model, R3)`` after a group's name in a line of text; '' when neither is shown."""
        parts = self.parts(key)
        return f" ({', '.join(parts)})" if parts else ""


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
    model: str | None = None
    routing: str = ROUTING_OFF

    @property
    def key(self) -> GroupKey:
        return GroupKey(self.algorithm, self.reuse, self.model, self.routing)


@dataclass(frozen=True)
class RunIdentity:
    """What a run is: from its manifest record, else from its log's file name (:data:`NAME_PATTERN`).

    ``lr`` and ``warm_seed`` are known only from a name that carries them (the miniature's). ``model`` is the name's
    part before the algorithm (the package's ``<model>-<algorithm>-n<N>-s<seed>``; for the miniature's runs of a task
    other than the chain task, that task), or the model folder after the seed in the presets' former names; None
    when the name says neither. ``routing`` is the replay mode (:data:`ROUTINGS`): the manifest's, else the name's
    suffix (:data:`ROUTING_AFTER_SEED`), off without one.
    """

    algorithm: str
    reuse: int
    seed: int
    lr: float | None = None
    warm_seed: int | None = None
    model: str | None = None
    routing: str = ROUTING_OFF


def _read_name(stem: str) -> tuple[RunIdentity, str | None] | None:
    """The run a name describes and the replay mode the name states (None when it states none)."""
    match = NAME_PATTERN.search(stem)
    if match is None:
        return None
    model = stem[: match.start()].rstrip("-_") or None
    tail = stem[match.end() :]
    stated = ROUTING_AFTER_SEED.match(tail)
    routing = None if stated is None else stated["routing"]
    former = FORMER_PRESET_TAIL.fullmatch(tail)
    if stated is None and model is None and match["lr"] is None and match["warm_seed"] is None and former:
        model, routing = former["model"], former["routing"]
    identity = RunIdentity(
        algorithm=match["algorithm"],
        reuse=int(match["reuse"]),
        seed=int(match["seed"]),
        lr=None if match["lr"] is None else float(match["lr"]),
        warm_seed=None if match["warm_seed"] is None else int(match["warm_seed"]),
        model=model,
        routing=routing or ROUTING_OFF,
    )
    return identity, routing


def parse_run_name(stem: str) -> RunIdentity | None:
    """The run a log file name (without ``.jsonl``) describes, or None when it does not say (:data:`NAME_PATTERN`)."""
    read = _read_name(stem)
    return None if read is None else read[0]


def identify(run: RunLog, record: RunRecord | None) -> RunIdentity:
    """The run's identity from the manifest record, else from the log's file name.

    The manifest has no model field: a record's model is its run name's (:func:`parse_run_name`), and its routing
    replay mode the record's ``routing``, else the run name's (the miniature records none and names an R2 run
    ``..._r2``).

    Raises:
        ValueError: the run cannot be identified, or the record's ``routing`` contradicts its run name's suffix.
    """
    if record is not None:
        read = _read_name(record.name)
        named, stated = read if read is not None else (None, None)
        if record.routing is not None and stated is not None and record.routing != stated:
            raise ValueError(
                f"{run.path}: the manifest says routing {record.routing}, its run name {record.name!r} says {stated}"
            )
        return RunIdentity(
            record.algorithm,
            record.reuse,
            record.seed,
            model=None if named is None else named.model,
            routing=record.routing or stated or ROUTING_OFF,
        )
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
        model=identity.model,
        routing=identity.routing,
    )


def check_group_consistency(runs: list[RunSummary], logs: dict[str, RunLog]) -> list[str]:
    """Reasons why the runs of one group (:class:`GroupKey`) must not be averaged; empty when they may.

    Model and routing replay mode are part of the group's key, so what is checked here is what else may differ: the
    configuration (manifest hash), the learning rate, repeated seeds.
    """
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


def late_difference(runs: list[RunSummary], reference: list[RunSummary]) -> tuple[float, tuple[float, float] | None]:
    """Mean late score of ``runs`` minus that of ``reference``, in percentage points, with its Welch t interval
    (:func:`welch_interval`, in percentage points; None with fewer than two runs on a side)."""
    a, b = [r.late for r in runs], [r.late for r in reference]
    ci = welch_interval(a, b)
    return 100.0 * (statistics.fmean(a) - statistics.fmean(b)), None if ci is None else (100.0 * ci[0], 100.0 * ci[1])


def summarise_groups(runs: list[RunSummary], logs: dict[str, RunLog]) -> tuple[list[GroupSummary], list[str]]:
    """Group runs by :class:`GroupKey` (algorithm, N, model, routing replay mode); returns the groups and the groups
    refused as mixed (with reasons). The difference to the baseline is taken at the same N, model and routing."""
    grouped: dict[GroupKey, list[RunSummary]] = defaultdict(list)
    for r in runs:
        grouped[r.key].append(r)
    variants = Variants.of(grouped)
    groups, refused = [], []
    # N, then the algorithm's name, as before runs had a model and a routing mode; those last, side by side.
    for key, members in sorted(grouped.items(), key=lambda kv: (kv[0].reuse, kv[0].algorithm, *key_order(kv[0]))):
        problems = check_group_consistency(members, logs)
        if problems:
            refused.append(f"{key.algorithm} N={key.reuse}{variants.tag(key)}: not averaged — " + "; ".join(problems))
            continue
        lates = [r.late for r in members]
        vals = defaultdict(list)
        for r in members:
            for k, v in r.val.items():
                vals[k].append(v)
        groups.append(
            GroupSummary(
                algorithm=key.algorithm,
                reuse=key.reuse,
                runs=sorted(members, key=lambda r: r.seed),
                late_mean=statistics.fmean(lates),
                late_std=statistics.stdev(lates) if len(lates) > 1 else None,
                early_mean=statistics.fmean(r.early for r in members),
                auc_mean=statistics.fmean(r.auc for r in members),
                length_mean=_mean_or_none([r.length for r in members]),
                starved_mass=_starved_mass_means(members),
                val={k: statistics.fmean(v) for k, v in vals.items()},
                model=key.model,
                routing=key.routing,
            )
        )
    baseline = {g.key._replace(algorithm=algorithms.BASELINE): g for g in groups if g.algorithm == algorithms.BASELINE}
    for g in groups:
        base = baseline.get(g.key._replace(algorithm=algorithms.BASELINE))
        if base is None or g is base:
            continue
        g.delta_pp, g.delta_ci = late_difference(g.runs, base.runs)
    return groups, refused


@dataclass(frozen=True)
class ReplayDifference:
    """The late score with routing replay minus without it, for one (algorithm, N, model).

    Attributes:
        replay: the group with routing replay (its ``routing`` is one of :data:`REPLAYED`).
        off: the group of the same algorithm, N and model without it.
        delta_pp, delta_ci: :func:`late_difference` of ``replay``'s runs against ``off``'s.
    """

    replay: GroupSummary
    off: GroupSummary
    delta_pp: float
    delta_ci: tuple[float, float] | None


def replay_differences(groups: list[GroupSummary], runs: list[RunSummary]) -> tuple[list[ReplayDifference], list[str]]:
    """What routing replay changes: each averaged group with replay against the group of the same algorithm, N and
    model without it, as the method table compares a method with the baseline (:func:`late_difference`).

    Returns:
        The differences in table order (:func:`key_order`), and one line for each (algorithm, N, model, mode) with
        replayed runs but no difference, with why.
    """
    by_key = {g.key: g for g in groups}
    run_keys = {r.key for r in runs}
    variants = Variants.of(run_keys)
    differences, left_out = [], []
    for key in sorted((k for k in run_keys if k.routing != ROUTING_OFF), key=key_order):
        off_key = key._replace(routing=ROUTING_OFF)
        name = f"{key.algorithm} N={key.reuse}{variants.tag(key)}"
        if key not in by_key:
            left_out.append(f"{name}: its runs are not averaged")
        elif off_key not in run_keys:
            left_out.append(f"{name}: no run without routing replay of the same model, algorithm and N")
        elif off_key not in by_key:
            left_out.append(f"{name}: its runs without routing replay are not averaged")
        else:
            replay, off = by_key[key], by_key[off_key]
            differences.append(ReplayDifference(replay, off, *late_difference(replay.runs, off.runs)))
    return differences, left_out


@dataclass(frozen=True)
class GapPoint:
    """One (algorithm, N, lr) cell against the baseline's cell at the same N and lr; means over seeds. Runs of
    different models or routing replay modes are different cells, each against the baseline's of its own.

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
    model: str | None = None
    routing: str = ROUTING_OFF

    @property
    def key(self) -> GroupKey:
        return GroupKey(self.algorithm, self.reuse, self.model, self.routing)


def format_lr(lr: float | None) -> str:
    return "lr not logged" if lr is None else f"lr {lr:g}"


def _cell_name(key: GroupKey, lr: float | None, variants: Variants) -> str:
    return f"{key.algorithm} N={key.reuse}{variants.tag(key)}, {format_lr(lr)}"


def gap_points(runs: list[RunSummary], logs: dict[str, RunLog]) -> tuple[list[GapPoint], list[str]]:
    """Late-score gap to the baseline against the method-independent starved mass, per (algorithm, N, lr) cell (and
    model and routing replay mode, :class:`GroupKey`).

    Every identified run counts, also those of a group refused for mixing learning rates: here the learning rate is
    part of the cell. A cell is a point when it and the baseline's cell at its N, lr, model and routing mode hold runs
    that may be averaged (:func:`check_group_consistency`) and each of its runs logs
    :data:`INDEPENDENT_STARVED_MASS_KEY`.

    Returns:
        The points, in table order, and one line for each cell of another algorithm that is not a point, with why.
    """
    cells: dict[tuple[GroupKey, float | None], list[RunSummary]] = defaultdict(list)
    for r in runs:
        cells[(r.key, r.cell_lr)].append(r)
    problems = {cell: check_group_consistency(members, logs) for cell, members in cells.items()}
    variants = Variants.of(key for key, _ in cells)
    points, left_out = [], []
    for cell in sorted(cells, key=lambda c: (algorithms.order(c[0].algorithm), *key_order(c[0]), _lr_order(c[1]))):
        key, lr = cell
        if key.algorithm == algorithms.BASELINE:
            continue
        members, base_cell = cells[cell], (key._replace(algorithm=algorithms.BASELINE), lr)
        name, base = _cell_name(key, lr, variants), algorithms.display_name(algorithms.BASELINE)
        where = f"N={key.reuse}{variants.tag(key)}, {format_lr(lr)}"
        if problems[cell]:
            left_out.append(f"{name}: not averaged — " + "; ".join(problems[cell]))
            continue
        if base_cell not in cells:
            left_out.append(f"{name}: no {base} run at {where}")
            continue
        if problems[base_cell]:
            left_out.append(f"{name}: {base}'s runs at {where} are not averaged")
            continue
        masses = [r.starved_mass(INDEPENDENT) for r in members]
        if None in masses:
            missing = sorted(r.name for r, m in zip(members, masses) if m is None)
            left_out.append(f"{name}: {', '.join(missing)} log no {INDEPENDENT_STARVED_MASS_KEY}")
            continue
        base_runs = cells[base_cell]
        base_masses = [r.starved_mass(INDEPENDENT) for r in base_runs]
        gap = statistics.fmean(r.late for r in members) - statistics.fmean(r.late for r in base_runs)
        points.append(
            GapPoint(
                algorithm=key.algorithm,
                reuse=key.reuse,
                lr=lr,
                starved_mass=statistics.fmean(masses),
                gap_pp=100.0 * gap,
                seeds=len(members),
                baseline_seeds=len(base_runs),
                baseline_starved_mass=None if None in base_masses else statistics.fmean(base_masses),
                model=key.model,
                routing=key.routing,
            )
        )
    return points, left_out


def _lr_order(lr: float | None) -> float:
    return -math.inf if lr is None else lr
