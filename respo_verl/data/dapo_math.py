#!/usr/bin/env python
"""DAPO-Math-17k (processed) -> verl parquet, prompts as the authors' preprocessing builds them.

    respo-verl prepare-data dapo-math --output ~/data/respo_verl/dapo_math_17k.parquet
    respo-verl prepare-data dapo-math --source local.parquet --output out.parquet

The source is an HF dataset name (default open-r1/DAPO-Math-17k-Processed, config ``all``) or a local
.parquet/.json/.jsonl with either the processed schema (``prompt`` string + ``solution``) or DAPO's original
(``prompt`` chat list + ``reward_model.ground_truth``). As in the authors' preprocessing, DAPO's answer-format
prefix is deleted and its closing line replaced by one space and "Please reason step by step, and put your final
answer within \\boxed{}."; the problem text is otherwise unchanged. Rewards: data_source ``math_dapo`` selects
verl's DAPO math verifier; the overlong buffer is a reward-manager setting (task/dapo_math_overlong.yaml), not
part of the data.

Which problems: the authors train on BytedTsinghua-SIA/DAPO-Math-17k as published, English and Chinese problems
alike. The ``all`` configuration of the processed copy is that release deduplicated by prompt, languages kept
(``en`` would drop the Chinese ones), so it is the default; no row is filtered by language.
"""

from __future__ import annotations

import argparse
import sys

from respo_verl.data.common import (
    DataError,
    answer_text,
    first_key,
    load_rows,
    make_row,
    strip_dapo_template,
    user_text,
    write_parquet,
)

DEFAULT_SOURCE = "open-r1/DAPO-Math-17k-Processed"
DEFAULT_CONFIG = "all"
DATA_SOURCE = "math_dapo"  # verl's default_compute_score routes it to the DAPO math verifier


def convert(rows: list[dict], source: str, split: str = "train") -> list[dict]:
    out = []
    for i, row in enumerate(rows):
        where = f"{source} row {i}"
        problem = strip_dapo_template(
            user_text(first_key(row, ("prompt", "source_prompt", "problem"), "problem", where))
        )
        if "solution" in row and row["solution"] is not None:
            answer = answer_text(row["solution"])
        else:
            reward = first_key(row, ("reward_model",), "answer (solution / reward_model)", where)
            answer = answer_text(reward.get("ground_truth", "") if isinstance(reward, dict) else reward)
        out.append(make_row(problem, answer, DATA_SOURCE, i, split, source))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default=DEFAULT_SOURCE, help="local file or HF dataset name")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="HF dataset config (ignored for local files)")
    p.add_argument("--split", default="train")
    p.add_argument("--output", required=True, help="output .parquet")
    p.add_argument("--limit", type=int, default=0, help="keep only the first N rows (0: all)")
    args = p.parse_args(argv)
    try:
        rows = load_rows(args.source, args.config, args.split)
        if args.limit > 0:
            rows = rows[: args.limit]
        if not rows:
            raise DataError(f"{args.source}: no rows")
        path = write_parquet(convert(rows, args.source, args.split), args.output)
    except DataError as err:
        print(f"respo-verl prepare-data dapo-math: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
