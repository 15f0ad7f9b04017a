"""The comparison report as a keyword API: :func:`build_report` (``respo-verl report`` is its command line)."""

from __future__ import annotations

import difflib
import statistics
from collections.abc import Sequence
from pathlib import Path

from respo_verl.tools.report.analysis import (
    NAME_EXAMPLES,
    ROUTING_OFF,
    RunSummary,
    Variants,
    gap_points,
    summarise_groups,
    summarise_run,
)
from respo_verl.tools.report.render import markdown_report, plots_section, write_plots
from respo_verl.tools.report.routing import group_routing, routing_section, run_routing
from respo_verl.tools.runs.logs import LogError, RunLog, read_log
from respo_verl.tools.runs.manifest import MANIFEST_NAME, RunRecord, read_manifest
from respo_verl.tools.runs.stats import REWARD_RANGES, SCORE_KEY


class ReportError(Exception):
    """A problem with the inputs, reported as one clear message (exit code 2)."""


def _collect(paths: list[Path], manifests: list[Path]) -> tuple[list[Path], list[Path]]:
    for manifest in manifests:
        if not manifest.is_file():
            raise ReportError(f"--manifest {manifest}: no such file")
    logs, found_manifests = [], list(manifests)
    for path in paths:
        if path.is_dir():
            found_manifests += sorted(path.rglob(MANIFEST_NAME))
            logs += sorted(p for p in path.rglob("*.jsonl") if p.name != MANIFEST_NAME)
        elif path.is_file():
            logs.append(path)
        else:
            raise ReportError(f"{path}: no such file or directory")
    return sorted(set(logs)), sorted(set(found_manifests))


def _records_by_log(manifests: list[Path]) -> dict[Path, RunRecord]:
    by_log = {}
    for manifest in manifests:
        try:
            records = read_manifest(manifest)
        except ValueError as exc:
            raise ReportError(str(exc)) from exc
        for record in records:
            log = Path(record.log)
            by_log[(log if log.is_absolute() else manifest.parent / log).resolve()] = record
    return by_log


def _check_metric(name: str, logs: list[RunLog], what: str) -> None:
    known = sorted({k for log in logs for k in log.metrics})
    if name not in known:
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; {len(known)} metrics are logged"
        raise ReportError(f"{what} {name!r} is not in any of the logs{hint}")


def build_report(
    paths: Sequence[Path],
    *,
    out: Path,
    manifests: Sequence[Path] = (),
    score_key: str = SCORE_KEY,
    reward_range: str = "pm1",
    metrics: Sequence[str] = (),
    plots: bool = True,
) -> tuple[str, list[Path]]:
    """Read the logs under ``paths`` (files, or folders searched with their manifests) and write the report.

    Args:
        paths: verl file-logger logs (``*.jsonl``) or folders searched recursively, with any manifest inside.
        out: the folder for ``report.md`` and the plots.
        manifests: manifest files beyond those found under ``paths``.
        score_key: the training-score metric.
        reward_range: ``pm1`` (a reward in [-1, 1], reported as (r+1)/2, as the paper) or ``01``.
        metrics: further metrics to tabulate (mean over the run, mean over seeds).
        plots: write the score, starved-mass and gap-against-starved-mass plots (listed in the report).

    Returns:
        The report's markdown and the files written. Raises :class:`ReportError` for unusable inputs.
    """
    if reward_range not in REWARD_RANGES:
        raise ReportError(f"reward range {reward_range!r}: choose from {', '.join(sorted(REWARD_RANGES))}")
    paths, metrics = list(paths), list(metrics)
    log_paths, manifests = _collect(paths, list(manifests))
    if not log_paths:
        raise ReportError(f"no *.jsonl logs under {', '.join(map(str, paths))}")
    records = _records_by_log(manifests)
    logs, skipped = [], []
    for path in log_paths:
        try:
            log = read_log(path)
        except LogError as exc:
            skipped.append(f"{path}: {exc}")
            continue
        skipped += log.skipped
        logs.append(log)
    if not logs:
        raise ReportError("no log holds a usable metric line:\n  " + "\n  ".join(skipped[:10]))
    _check_metric(score_key, logs, "score metric")
    for name in metrics:
        _check_metric(name, logs, "metric")
    runs: list[RunSummary] = []
    logs_by_run: dict[str, RunLog] = {}
    for log in logs:
        record = records.get(log.path.resolve())
        try:
            summary = summarise_run(log, record, score_key, reward_range)
        except KeyError:
            skipped.append(f"{log.path}: no {score_key} values; run left out")
            continue
        except LogError as exc:  # the log contradicts its manifest or the declared range: no number is safe
            raise ReportError(str(exc)) from None
        except ValueError as exc:  # not identifiable: listed, left out
            skipped.append(str(exc))
            continue
        if summary.name in logs_by_run:
            raise ReportError(f"two logs for run {summary.name!r}: {logs_by_run[summary.name].path} and {log.path}")
        runs.append(summary)
        logs_by_run[summary.name] = log
    if not runs:
        raise ReportError(
            f"no run identified in {', '.join(map(str, paths))}: read {len(logs)} log(s) and {len(manifests)} "
            f"manifest(s); a run is a log with {score_key} values that a {MANIFEST_NAME} lists or whose file name says "
            f"its algorithm, N and seed ({', '.join(NAME_EXAMPLES)})"
        )
    seen = {log.path.resolve() for log in logs}
    skipped += [f"{r.name}: in the manifest but no log at {p}" for p, r in records.items() if p not in seen]
    groups, refused = summarise_groups(runs, logs_by_run)
    gap = gap_points(runs, logs_by_run)
    text = markdown_report(groups, runs, refused, skipped, reward_range, gap)
    used = [r for g in groups for r in g.runs]
    drift = {
        r.name: run_routing(r.name, r.algorithm, r.reuse, r.seed, r.log_step, logs_by_run[r.name], r.model, r.routing)
        for r in used
    }
    routing = group_routing([d for d in drift.values() if d is not None])
    without = [name for name, d in drift.items() if d is None]
    replayed = any(r.routing != ROUTING_OFF for r in used)
    text += "\n" + "\n".join(routing_section(routing, without, replayed))
    if metrics:
        text += "\n## Requested metrics (mean over the run, mean over seeds)\n\n"
        variants = Variants.of(g.key for g in groups)
        header = ["method", *variants.headers(), "N", *metrics]
        text += "| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n"
        for g in groups:
            cells = [g.algorithm, *variants.cells(g.key), str(g.reuse)]
            for name in metrics:
                per_run = [statistics.fmean(s.values()) for r in g.runs if (s := logs_by_run[r.name].series(name))]
                cells.append(f"{statistics.fmean(per_run):.4g}" if per_run else "—")
            text += "| " + " | ".join(cells) + " |\n"
    outputs = [out / "report.md"]
    try:
        out.mkdir(parents=True, exist_ok=True)
        if plots:
            outputs += write_plots(groups, gap[0], routing, out)
        text += plots_section([p.name for p in outputs[1:]])
        outputs[0].write_text(text)
    except OSError as exc:
        raise ReportError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    return text, outputs
