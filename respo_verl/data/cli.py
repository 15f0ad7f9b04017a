"""``respo-verl prepare-data {dapo-math,eval-math} ...``: write the paper's training or evaluation sets as parquet."""

from __future__ import annotations

import sys

# dataset -> (module with main(argv), one-line help)
DATASETS = {
    "dapo-math": ("respo_verl.data.dapo_math", "DAPO-Math-17k (processed) -> the training parquet"),
    "eval-math": ("respo_verl.data.eval_math", "AIME24, AIME25, AMC23 -> the evaluation parquet files"),
}


def _usage() -> str:
    lines = ["usage: respo-verl prepare-data <dataset> [options]", "", "datasets:"]
    lines += [f"  {name.ljust(10)}  {summary}" for name, (_, summary) in DATASETS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import importlib

    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv or argv[0] not in DATASETS:
        got = f"unknown dataset {argv[0]!r}" if argv else "a dataset is required"
        print(f"respo-verl prepare-data: {got}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(DATASETS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)
