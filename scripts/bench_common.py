"""Helpers shared by the benchmark scripts in this directory (imported as ``bench_common``)."""

from __future__ import annotations

import json
import platform
import statistics


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(Q1, median, Q3) with the inclusive method; a single value is all three."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(report: dict, path: str | None) -> None:
    """Write ``report`` to ``path`` (if given) and say where."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nJSON written to {path}")
