#!/usr/bin/env python
"""AIME24, AIME25 and AMC23 -> verl validation parquet (one file per benchmark), prompts as the authors built them.

    respo-verl prepare-data eval-math --output-dir ~/data/respo_verl
    respo-verl prepare-data eval-math --benchmark aime24 --source aime24.jsonl --output-dir out/

Each benchmark reads an HF dataset (defaults below) or a local .parquet/.json/.jsonl with a problem column
(problem / question / prompt) and an answer column (answer / solution / ground_truth). data_source is ``aime24``
and ``aime25`` (verl sends ``aime*`` to the DAPO math verifier) and ``math_dapo`` for AMC23, because verl 0.9.1's
default scorer knows no AMC source; ``extra_info.source`` keeps the benchmark name.

Prompts follow the authors' preprocessing: the problem text unchanged, one space, then "Let's think step by step
and output the final answer within \\boxed{}." for AIME24 / AIME25 and "Please reason step by step, and put your
final answer within \\boxed{}." for AMC23; the default datasets are the ones that code reads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from respo_verl.data.common import (
    AIME_SUFFIX,
    PROMPT_SUFFIX,
    DataError,
    answer_text,
    first_key,
    load_rows,
    make_row,
    user_text,
    write_parquet,
)

# benchmark -> (default HF dataset, config, split, data_source, instruction appended to the problem)
BENCHMARKS: dict[str, tuple[str, str | None, str, str, str]] = {
    "aime24": ("HuggingFaceH4/aime_2024", None, "train", "aime24", AIME_SUFFIX),
    "aime25": ("math-ai/aime25", None, "test", "aime25", AIME_SUFFIX),
    "amc23": ("math-ai/amc23", None, "test", "math_dapo", PROMPT_SUFFIX),
}
PROBLEM_KEYS = ("problem", "question", "prompt", "Problem", "Question")
ANSWER_KEYS = ("answer", "Answer", "ground_truth", "solution")


def convert(rows: list[dict], benchmark: str, source: str) -> list[dict]:
    data_source, suffix = BENCHMARKS[benchmark][3:]
    out = []
    for i, row in enumerate(rows):
        where = f"{source} row {i}"
        problem = user_text(first_key(row, PROBLEM_KEYS, "problem", where))
        answer = answer_text(first_key(row, ANSWER_KEYS, "answer", where))
        out.append(make_row(problem, answer, data_source, i, "test", benchmark, suffix))
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
        print("respo-verl prepare-data eval-math: --source needs a single --benchmark", file=sys.stderr)
        return 2
    try:
        for name in names:
            dataset, config, split, *_ = BENCHMARKS[name]
            source = args.source or dataset
            rows = load_rows(source, config, args.split or split)
            if not rows:
                raise DataError(f"{source}: no rows")
            path = write_parquet(convert(rows, name, source), Path(args.output_dir) / f"{name}.parquet")
            print(f"wrote {len(rows)} rows to {path}")
    except DataError as err:
        print(f"respo-verl prepare-data eval-math: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
