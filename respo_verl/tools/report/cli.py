"""``respo-verl report``: read verl file-logger logs (and the sweep manifest) and write the comparison report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from respo_verl.tools.report.build import ReportError, build_report
from respo_verl.tools.runs.manifest import MANIFEST_NAME
from respo_verl.tools.runs.stats import REWARD_RANGES, SCORE_KEY


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


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        text, outputs = build_report(
            args.paths,
            out=args.out,
            manifests=args.manifest,
            score_key=args.score_key,
            reward_range=args.reward_range,
            metrics=args.metric,
            plots=not args.no_plots,
        )
    except ReportError as exc:
        print(f"respo-verl report: {exc}", file=sys.stderr)
        return 2
    print(text)
    print("written: " + ", ".join(str(p) for p in outputs))
    return 0
