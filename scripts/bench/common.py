"""Helpers shared by the benchmark scripts in this directory (imported as ``common``: run them as scripts)."""

from __future__ import annotations

import json
import statistics

from respo_verl.tools.runs.machine import cpu_name  # noqa: F401  (re-exported for the benchmarks)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(Q1, median, Q3) with the inclusive method; a single value is all three."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def write_json(report: dict, path: str | None) -> None:
    """Write ``report`` to ``path`` (if given) and say where."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nJSON written to {path}")
