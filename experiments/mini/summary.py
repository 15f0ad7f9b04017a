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


def late_by_seed(done, out: Path) -> dict[str, dict[int, float]]:
    """algorithm → RL seed → late score in [0, 1] (``respo-verl report``'s: last 128 updates), from the logs.

    Args:
        done: (RunConfig, JobResult) pairs.
    """
    from respo_verl.tools.runs.logs import read_log
    from respo_verl.tools.runs.stats import score_curve, window_stats

    scores: dict[str, dict[int, float]] = defaultdict(dict)
    for cfg, result in done:
        curve, _ = score_curve(read_log(Path(result.log)), cfg.reuse, "optimizer")
        scores[cfg.algorithm][cfg.seed] = window_stats(curve).late
    return dict(scores)


def ablation_markdown(late: dict[str, dict[int, float]], lr: float, reuse: int) -> list[str]:
    """The ablation's table (late score per method, mean over seeds) and its paired gap decomposition.

    Args:
        late: :func:`late_by_seed`.
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
