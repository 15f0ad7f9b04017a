"""What the miniature writes after its runs: the learning-rate choice, the regime checks, ``results.md`` and the
report views (``respo-verl report``'s keyword API on subsets of the runs)."""

from __future__ import annotations

import shlex
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments.mini import protocol

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
