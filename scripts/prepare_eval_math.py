#!/usr/bin/env python
"""AIME24, AIME25 and AMC23 -> verl validation parquet (one file per benchmark) with the paper's prompt suffix.

    python scripts/prepare_eval_math.py --output-dir ~/data/respo_verl
    python scripts/prepare_eval_math.py --benchmark aime24 --source aime24.jsonl --output-dir out/

Each benchmark reads an HF dataset (defaults below) or a local .parquet/.json/.jsonl with a problem column
(problem / question / prompt) and an answer column (answer / solution / ground_truth). data_source is ``aime24``
and ``aime25`` (verl sends ``aime*`` to the DAPO math verifier) and ``math_dapo`` for AMC23, because verl 0.9.1's
default scorer knows no AMC source; ``extra_info.source`` keeps the benchmark name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from math_data_common import DataError, answer_text, first_key, load_rows, make_row, user_text, write_parquet

# benchmark -> (default HF dataset, config, split, data_source)
BENCHMARKS: dict[str, tuple[str, str | None, str, str]] = {
    "aime24": ("HuggingFaceH4/aime_2024", None, "train", "aime24"),
    "aime25": ("yentinglin/aime_2025", None, "train", "aime25"),
    "amc23": ("math-ai/amc23", None, "test", "math_dapo"),
}
PROBLEM_KEYS = ("problem", "question", "prompt", "Problem", "Question")
ANSWER_KEYS = ("answer", "Answer", "ground_truth", "solution")


def convert(rows: list[dict], benchmark: str, source: str) -> list[dict]:
    data_source = BENCHMARKS[benchmark][3]
    out = []
    for i, row in enumerate(rows):
        where = f"{source} row {i}"
        problem = user_text(first_key(row, PROBLEM_KEYS, "problem", where))
        answer = answer_text(first_key(row, ANSWER_KEYS, "answer", where))
        out.append(make_row(problem, answer, data_source, i, "test", benchmark))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--benchmark", choices=[*BENCHMARKS, "all"], default="all")
    p.add_argument("--source", help="local file or HF dataset name (only with a single --benchmark)")
    p.add_argument("--split", help="HF split (default: the benchmark's)")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    names = list(BENCHMARKS) if args.benchmark == "all" else [args.benchmark]
    if args.source and len(names) > 1:
        print("prepare_eval_math: --source needs a single --benchmark", file=sys.stderr)
        return 2
    try:
        for name in names:
            dataset, config, split, _ = BENCHMARKS[name]
            source = args.source or dataset
            rows = load_rows(source, config, args.split or split)
            if not rows:
                raise DataError(f"{source}: no rows")
            path = write_parquet(convert(rows, name, source), Path(args.output_dir) / f"{name}.parquet")
            print(f"wrote {len(rows)} rows to {path}")
    except DataError as err:
        print(f"prepare_eval_math: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
