"""What the miniature writes after its runs: the learning-rate choice, the regime checks, ``results.md`` and the
report views (``respo-verl report``'s keyword API on subsets of the runs)."""

from __future__ import annotations

import math
import shlex
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments.mini import protocol
from respo_verl.core.diagnostics import INDEPENDENT_STARVED_MASS_KEY

# Confidence level of every interval the miniature prints (the report's Welch intervals use the same).
CONFIDENCE = 0.95

# Metrics the report tabulates for the miniature (mean over the run): clipped gradient norms, the task.
REPORT_METRICS = (
    "mini/grad_clipped",
    "mini/gave_up_frac",
    "mini/slipped_frac",
    "mini/response_length/correct_mean",
    "mini/response_length/wrong_mean",
)


def grid_regime(done) -> dict:
    """(algorithm, lr) → the regime checks of the grid runs at N = GRID_REUSE, pooled over their seeds.

    Args:
        done: (RunConfig, JobResult) pairs.
    """
    from experiments.mini import regime

    runs = defaultdict(list)
    for cfg, result in done:
        if cfg.reuse == protocol.GRID_REUSE:
            runs[(cfg.algorithm, cfg.lr)].append((result.stale_totals, result.stale_shares))
    return {key: regime.pool(protocol.GRID_REUSE, parts) for key, parts in runs.items()}


def pooled_regime_lines(done) -> list[str]:
    """One line per (method, rate) of :func:`grid_regime`: the regime checks of its runs at N = GRID_REUSE pooled
    over their seeds (empty when no run is at that N)."""
    from respo_verl import algorithms

    pooled = grid_regime(done)
    keys = sorted(pooled, key=lambda k: (k[1], algorithms.order(k[0])))
    return [f"- {a}, lr {lr:g}: {pooled[(a, lr)].line()}" for a, lr in keys]


def late_scores(records, out: Path) -> dict[tuple[str, float], float]:
    """(algorithm, lr) → mean late score over seeds, from the logs (``respo_verl.tools.runs.stats``)."""
    from respo_verl.tools.runs.logs import read_log
    from respo_verl.tools.runs.stats import score_curve, window_stats

    by_setting = defaultdict(list)
    for record, cfg in records:
        curve, _ = score_curve(read_log(out / record.log), record.reuse, "optimizer")
        by_setting[(cfg.algorithm, cfg.lr)].append(window_stats(curve).late)
    return {k: statistics.fmean(v) for k, v in by_setting.items()}


@dataclass(frozen=True)
class RateChoice:
    """The protocol's learning rates after the grid: each method's best, the rates in the regime, the common one."""

    best: dict[str, float]
    in_regime: list[float]
    common: float

    def line(self) -> str:
        return (
            f"learning rates (late score at N = {protocol.GRID_REUSE}): best per method "
            + ", ".join(f"{a} {lr:g}" for a, lr in self.best.items())
            + "; in the regime for every method (grid runs pooled per method): "
            + (", ".join(f"{lr:g}" for lr in self.in_regime) or "none")
            + f"; common (chosen on {', '.join(protocol.BASELINES)}"
            + (" among the rates in the regime" if self.in_regime else ", no rate being in the regime")
            + f") {self.common:g}"
        )


def choose_rates(algos: list[str], records, done, out: Path) -> RateChoice:
    """The protocol's choice of learning rates from the grid's runs (``protocol.best_lr``, ``common_lr``)."""
    late = late_scores(records, out)
    in_regime = protocol.regime_rates(grid_regime(done))
    return RateChoice(
        best={a: protocol.best_lr(late, a) for a in algos},
        in_regime=in_regime,
        common=protocol.common_lr(late, eligible=in_regime or None),
    )


def report_view(name: str, records, out: Path) -> tuple[str, Path]:
    """``respo-verl report`` on a subset of the runs (its own manifest under ``out/report/<name>``)."""
    from respo_verl.tools.report.build import build_report
    from respo_verl.tools.runs.logs import read_log
    from respo_verl.tools.runs.manifest import write_manifest

    view = out / "report" / name
    absolute = [type(r)(**{**asdict(r), "log": str((out / r.log).resolve())}) for r in records]
    manifest = write_manifest(absolute, view)
    logged = {k for r in absolute for k in read_log(Path(r.log)).metrics}  # a metric NaN throughout is left out
    text, _ = build_report(
        [Path(r.log) for r in absolute],
        out=view,
        manifests=[manifest],
        metrics=[m for m in REPORT_METRICS if m in logged],
    )
    return text, view / "report.md"


def results_markdown(argv: list[str], host: dict, threads: int, workers: int, done, wall_s: float) -> list[str]:
    """The head of ``results.md``: command, machine, regime checks and the task's numbers per run."""
    regime_lines = [f"- {r.name}: {r.regime.line()}" for _, r in done]
    held = [r.name for _, r in done if r.regime.holds]
    regime_lines += [
        "",
        f"In the regime: {len(held)} of {len(done)} runs" + (f" ({', '.join(held)})" if held else "") + ". The "
        'scores of a run outside it do not test the paper\'s claim (docs/mini.md, "Regime checks").',
    ]
    task_lines = [
        f"- {r.name}: score of the first rollout batch {100 * r.first_score:.1f} %, last quarter: correct "
        f"answers {r.last_quarter_correct_length:.0f} tokens, correct/wrong length "
        f"{r.last_quarter_length_ratio:.2f}"
        for _, r in done
    ]
    return [
        "# The miniature",
        "",
        f"command: `python -m experiments.mini {shlex.join(argv)}`  ",
        f"machine: {host['cpu']} ({host['cpu_count']} CPUs), torch {host['torch']}, {threads} thread(s) per run, "
        f"{workers} worker(s); {len(done)} runs in {wall_s:.0f} s",
        "",
        "## Regime checks (stale half of every rollout batch)",
        "",
        *regime_lines,
        "",
        "## Task",
        "",
        *task_lines,
        "",
    ]


@dataclass(frozen=True)
class PairedDifference:
    """mean(a − b) over paired values with its paired Student-t interval.

    Attributes:
        mean: mean of the differences d_i = a_i − b_i.
        low, high: the ``CONFIDENCE`` interval mean ± t_{n−1}·sd(d)/√n (NaN with fewer than two pairs).
        n: number of pairs.
        sd: sample standard deviation of the differences (n − 1 in the denominator).
    """

    mean: float
    low: float
    high: float
    n: int
    sd: float


def paired_difference(a: list[float], b: list[float], confidence: float = CONFIDENCE) -> PairedDifference:
    """Paired t interval of mean(a − b): the i-th values of ``a`` and ``b`` are one pair (same warm start, RL seed).

    A secondary analysis beside the protocol's Welch interval (``respo-verl report``), which treats the two samples
    as independent. ValueError when the lists differ in length or are empty.
    """
    from scipy import stats as scipy_stats

    if len(a) != len(b) or not a:
        raise ValueError(f"paired values need two lists of one non-zero length, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return PairedDifference(mean, math.nan, math.nan, 1, math.nan)
    sd = statistics.stdev(diffs)
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2, len(diffs) - 1)) * sd / math.sqrt(len(diffs))
    return PairedDifference(mean, mean - half, mean + half, len(diffs), sd)


# The gap decomposition of the branch ablation: (label, method, reference).
ABLATION_GAPS = (
    ("ReSPO − VESPO (the gap)", "respo", "vespo"),
    ("respo_pos − VESPO (positive branch's share)", "respo_pos", "vespo"),
    ("respo_neg − VESPO (negative branch's share)", "respo_neg", "vespo"),
)


STARVED_KEY = INDEPENDENT_STARVED_MASS_KEY
EVAL_KEY = "mini/eval/score"


def scores_by_seed(done) -> dict[tuple[str, int], dict[str, dict[int, float]]]:
    """(algorithm, N) → measure → RL seed → value, from the runs' logs.

    The measures: ``late``, ``respo-verl report``'s late score in [0, 1] (mean over the last 128 updates);
    ``starved``, the method-independent starved mass share (:data:`STARVED_KEY`, the share of gradient mass on
    positives with log W < −1, whatever the loss) averaged over every update of the run; ``eval``, the held-out score
    of the final policy where the run has one (:data:`EVAL_KEY`).

    Args:
        done: (RunConfig, JobResult) pairs.
    """
    from respo_verl.tools.runs.logs import read_log
    from respo_verl.tools.runs.stats import score_curve, window_stats

    scores: dict[tuple[str, int], dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for cfg, result in done:
        log = read_log(Path(result.log))
        cell = scores[(cfg.algorithm, cfg.reuse)]
        curve, _ = score_curve(log, cfg.reuse, "optimizer")
        cell["late"][cfg.seed] = window_stats(curve).late
        starved = [v for v in log.series(STARVED_KEY).values() if math.isfinite(v)]
        if starved:
            cell["starved"][cfg.seed] = statistics.fmean(starved)
        evaluated = log.series(EVAL_KEY)
        if evaluated:
            cell["eval"][cfg.seed] = evaluated[max(evaluated)]
    return {key: dict(value) for key, value in scores.items()}


def sign_flip_p(diffs: list[float]) -> float:
    """Exact two-sided sign-flip permutation p-value of mean(diffs) = 0: the share of the 2^n sign assignments whose
    |mean| is at least the observed one (the pairs are exchangeable under no difference). ValueError when empty or
    with more than 20 pairs (2^20 assignments)."""
    import itertools

    if not diffs or len(diffs) > 20:
        raise ValueError(f"the exact sign-flip test takes 1 to 20 paired differences, got {len(diffs)}")
    observed = abs(statistics.fmean(diffs)) - 1e-12 * max(1.0, max(abs(d) for d in diffs))
    flips = itertools.product((1.0, -1.0), repeat=len(diffs))
    extreme = sum(abs(statistics.fmean(s * d for s, d in zip(signs, diffs))) >= observed for signs in flips)
    return extreme / 2 ** len(diffs)


def paired_row(label: str, a: dict[int, float], b: dict[int, float]) -> str:
    """One markdown row of ``a − b`` in pp over their common seeds: mean, paired 95 % t interval, sign-flip p, the
    mean per warm start (the hierarchy: seeds of one warm start share a base model), per seed."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError(f"{label}: no seed has both values")
    diffs = [100 * (a[s] - b[s]) for s in seeds]
    d = paired_difference(diffs, [0.0] * len(diffs))
    per_warm = defaultdict(list)
    for s, x in zip(seeds, diffs):
        per_warm[protocol.warm_seed(s)].append(x)
    warm = ", ".join(f"w{w}: {statistics.fmean(v):+.2f}" for w, v in sorted(per_warm.items()))
    return (
        f"| {label} | {len(seeds)} | {d.mean:+.2f} | [{d.low:+.2f}, {d.high:+.2f}] | {sign_flip_p(diffs):.3f} "
        f"| {warm} | {', '.join(f'{x:+.2f}' for x in diffs)} |"
    )


PAIRED_HEADER = (
    "| difference | pairs | mean (pp) | paired 95 % t interval (pp) | sign-flip p | mean per warm start (pp) "
    "| per seed (pp) |",
    "|---|---:|---:|---|---:|---|---|",
)


def grid_markdown(grid: protocol.Grid, scores: dict[tuple[str, int], dict[str, dict[int, float]]]) -> list[str]:
    """The tables of the trend and horizon grids: per (method, N) the late score, the method-independent starved
    mass and the held-out score (mean ± sd over seeds), then the paired differences to VESPO at each N (and, for the
    trend, the change of ReSPO − VESPO from N = 8 to N = 32, paired over seeds)."""
    from respo_verl import algorithms

    def mean_sd(values: dict[int, float], scale: float = 100.0) -> str:
        if not values:
            return "—"
        xs = [scale * v for v in values.values()]
        sd = statistics.stdev(xs) if len(xs) > 1 else math.nan
        return f"{statistics.fmean(xs):.2f} ± {sd:.2f}"

    held_out = any(cell.get("eval") for cell in scores.values())
    seeds = sorted({s for cell in scores.values() for s in cell["late"]})
    lines = [
        f"{grid.about}; RL seeds run: {', '.join(map(str, seeds))}; lr {grid.lr:g}, "
        f"{grid.optimizer_steps} updates per run, late = the last "
        "128 updates; starved mass: the method-independent share of gradient mass on positives with log W < −1, "
        "mean over the run's updates.",
        "",
        "| method | N | runs | late score (%) | starved mass (%) |" + (" held-out score (%) |" if held_out else ""),
        "|---|---:|---:|---:|---:|" + ("---:|" if held_out else ""),
    ]
    keys = sorted(scores, key=lambda k: (k[1], algorithms.order(k[0])))
    for algorithm, n in keys:
        cell = scores[(algorithm, n)]
        row = f"| {algorithms.display_name(algorithm)} | {n} | {len(cell['late'])} | {mean_sd(cell['late'])} "
        row += f"| {mean_sd(cell.get('starved', {}))} |"
        lines.append(row + (f" {mean_sd(cell.get('eval', {}))} |" if held_out else ""))
    lines += ["", *PAIRED_HEADER]
    baseline = algorithms.BASELINE
    for measure in ("late", "eval") if held_out else ("late",):
        for algorithm, n in keys:
            if algorithm == baseline or (baseline, n) not in scores or measure not in scores[(algorithm, n)]:
                continue
            name = algorithms.display_name(algorithm) if algorithm in algorithms.ALGORITHMS else algorithm
            label = f"{name} − VESPO, N = {n}" + (", held-out" if measure == "eval" else "")
            lines.append(paired_row(label, scores[(algorithm, n)][measure], scores[(baseline, n)][measure]))
    ns = sorted({n for _, n in scores})
    if len(ns) > 1 and all(("respo", n) in scores and (baseline, n) in scores for n in (ns[0], ns[-1])):
        lo, hi = ns[0], ns[-1]

        def gap(n: int) -> dict[int, float]:
            a, b = scores[("respo", n)]["late"], scores[(baseline, n)]["late"]
            return {s: a[s] - b[s] for s in set(a) & set(b)}

        lines.append(paired_row(f"(ReSPO − VESPO at N = {hi}) − (at N = {lo})", gap(hi), gap(lo)))
    return [*lines, ""]


def ablation_markdown(late: dict[str, dict[int, float]], lr: float, reuse: int) -> list[str]:
    """The ablation's table (late score per method, mean over seeds) and its paired gap decomposition.

    Args:
        late: algorithm → RL seed → late score in [0, 1] (the ``late`` measure of :func:`scores_by_seed`).
        lr, reuse: the runs' learning rate and N, for the caption.
    """
    from respo_verl import algorithms

    seeds = sorted(set.intersection(*(set(v) for v in late.values())))
    warm = sorted({protocol.warm_seed(s) for s in seeds})
    lines = [
        f"Branch ablation at N = {reuse}, lr {lr:g}, 192 updates; RL seeds {', '.join(map(str, seeds))} "
        f"(warm starts {', '.join(map(str, warm))}; seed s starts from warm start s mod {protocol.N_WARM_STARTS}): "
        f"{len(seeds)} paired seeds.",
        "",
        "| method | runs | late score (%) | sd (pp) |",
        "|---|---:|---:|---:|",
    ]
    for name in sorted(late, key=algorithms.order):
        values = [100 * late[name][s] for s in seeds]
        sd = statistics.stdev(values) if len(values) > 1 else math.nan
        lines.append(
            f"| {algorithms.display_name(name)} (`{name}`) | {len(values)} | {statistics.fmean(values):.2f} "
            f"| {sd:.2f} |"
        )
    lines += [
        "",
        f"Gap decomposition: paired differences over the {len(seeds)} seeds (a pair: the same warm start and RL "
        f"seed, hence the same base model, prompts and first rollout batch), {CONFIDENCE:.0%} paired t interval.",
        "",
        "| difference | mean (pp) | paired 95 % interval (pp) | per seed (pp) |",
        "|---|---:|---|---|",
    ]
    for label, a, b in ABLATION_GAPS:
        if a not in late or b not in late:
            continue
        d = paired_difference([100 * late[a][s] for s in seeds], [100 * late[b][s] for s in seeds])
        per_seed = ", ".join(f"{100 * (late[a][s] - late[b][s]):+.2f}" for s in seeds)
        lines.append(f"| {label} | {d.mean:+.2f} | [{d.low:+.2f}, {d.high:+.2f}] | {per_seed} |")
    return [*lines, ""]
