"""``respo-verl report``: read verl file-logger logs (and the sweep manifest) and write the comparison report."""

from __future__ import annotations

import argparse
import difflib
import statistics
import sys
from pathlib import Path

from respo_verl.report.analysis import RunSummary, summarise_groups, summarise_run
from respo_verl.report.render import markdown_report, plot_scores, plot_starved_mass
from respo_verl.runs.logs import LogError, RunLog, read_log
from respo_verl.runs.manifest import MANIFEST_NAME, RunRecord, read_manifest
from respo_verl.runs.stats import REWARD_RANGES, SCORE_KEY


class ReportError(Exception):
    """A problem with the inputs, reported as one clear message (exit code 2)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="respo-verl report", description=__doc__)
    p.add_argument("paths", nargs="+", type=Path, help="log files (*.jsonl) or directories searched recursively")
    p.add_argument("--manifest", type=Path, action="append", default=[], help="manifest file(s); default: any "
                   f"{MANIFEST_NAME} inside the given directories")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("report"), help="output directory (default: ./report)")
    p.add_argument("--score-key", default=SCORE_KEY, help=f"training-score metric (default {SCORE_KEY})")
    p.add_argument(
        "--reward-range",
        choices=sorted(REWARD_RANGES),
        default="pm1",
        help="pm1: the score metric is a reward in [-1, 1], reported as (r+1)/2 (the paper); 01: already in [0, 1]. "
        "A logged value outside the declared range stops the report",
    )
    p.add_argument("--metric", action="append", default=[], help="extra metric to tabulate (mean over the run)")
    p.add_argument("--no-plots", action="store_true")
    return p


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


def build_report(args: argparse.Namespace) -> tuple[str, list[Path]]:
    log_paths, manifests = _collect(args.paths, args.manifest)
    if not log_paths:
        raise ReportError(f"no *.jsonl logs under {', '.join(map(str, args.paths))}")
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
    _check_metric(args.score_key, logs, "score metric")
    for name in args.metric:
        _check_metric(name, logs, "metric")
    runs: list[RunSummary] = []
    logs_by_run: dict[str, RunLog] = {}
    for log in logs:
        record = records.get(log.path.resolve())
        try:
            summary = summarise_run(log, record, args.score_key, args.reward_range)
        except KeyError:
            skipped.append(f"{log.path}: no {args.score_key} values; run left out")
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
    seen = {log.path.resolve() for log in logs}
    skipped += [f"{r.name}: in the manifest but no log at {p}" for p, r in records.items() if p not in seen]
    groups, refused = summarise_groups(runs, logs_by_run)
    text = markdown_report(groups, runs, refused, skipped, args.reward_range)
    if args.metric:
        text += "\n## Requested metrics (mean over the run, mean over seeds)\n\n"
        text += "| method | N | " + " | ".join(args.metric) + " |\n|---|---|" + "---|" * len(args.metric) + "\n"
        for g in groups:
            cells = []
            for name in args.metric:
                per_run = [statistics.fmean(s.values()) for r in g.runs if (s := logs_by_run[r.name].series(name))]
                cells.append(f"{statistics.fmean(per_run):.4g}" if per_run else "—")
            text += f"| {g.algorithm} | {g.reuse} | " + " | ".join(cells) + " |\n"
    outputs = [args.out / "report.md"]
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        outputs[0].write_text(text)
        if not args.no_plots and groups:
            outputs += plot_scores(groups, args.out)
            mass = plot_starved_mass(groups, args.out)
            if mass is not None:
                outputs.append(mass)
    except OSError as exc:
        raise ReportError(f"--out {args.out}: cannot write there ({exc.strerror or exc})") from None
    return text, outputs


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        text, outputs = build_report(args)
    except ReportError as exc:
        print(f"respo-verl report: {exc}", file=sys.stderr)
        return 2
    print(text)
    print("written: " + ", ".join(str(p) for p in outputs))
    return 0
