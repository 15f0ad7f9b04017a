"""Reader for verl's file-logger logs: one JSON object ``{"step": <int>, "data": {<metric>: <value>}}`` per line.

verl writes one line per training step (``trainer.logger=[...,file]``; path ``$VERL_FILE_LOGGER_PATH`` or
``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``); ``respo-verl mini`` writes the same format. A run killed
mid-write leaves a truncated last line, and NaN metrics arrive as ``null``: both are expected and reported, not
fatal. Anything else malformed is skipped with its line number, never guessed at.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunLog:
    """Metrics of one run, by training step.

    Attributes:
        path: the log file.
        metrics: metric name -> {training step: value}; only finite numbers.
        skipped: human-readable notes on every line or value that was not used.
    """

    path: Path
    metrics: dict[str, dict[int, float]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return sorted({s for series in self.metrics.values() for s in series})

    @property
    def last_step(self) -> int:
        steps = self.steps
        return steps[-1] if steps else 0

    def series(self, key: str) -> dict[int, float]:
        return self.metrics.get(key, {})


def read_log(path: Path) -> RunLog:
    """Parse one file-logger log; raise FileNotFoundError / ValueError only when nothing usable is in it."""
    path = Path(path)
    run = RunLog(path)
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for lineno, raw in enumerate(lines, start=1):
        where = f"{path.name}:{lineno}"
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            truncated = lineno == len(lines) and not raw.rstrip().endswith(b"}")
            run.skipped.append(f"{where}: {'truncated last line' if truncated else 'not JSON'} ({exc})")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("data"), dict):
            run.skipped.append(f"{where}: not a file-logger record (expected {{'step': int, 'data': {{...}}}})")
            continue
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            run.skipped.append(f"{where}: step {step!r} is not a non-negative integer")
            continue
        for key, value in record["data"].items():
            if value is None:
                run.skipped.append(f"{where}: {key} is null (NaN when logged)")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue  # strings and lists (e.g. config dumps) are not metrics
            if not math.isfinite(value):
                run.skipped.append(f"{where}: {key} = {value}")
                continue
            series = run.metrics.setdefault(key, {})
            if step in series:
                run.skipped.append(f"{where}: step {step} of {key} logged twice; the later value is used")
            series[step] = float(value)
    if not run.metrics:
        raise ValueError(f"{path}: no usable metric lines ({len(run.skipped)} skipped: {run.skipped[:3]})")
    return run
