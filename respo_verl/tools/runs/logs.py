"""Reader for verl's file-logger logs: one JSON object ``{"step": <int>, "data": {<metric>: <value>}}`` per line.

verl writes one line per training step (``trainer.logger=[...,file]``; path ``$VERL_FILE_LOGGER_PATH`` or
``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``), and a training step is N optimizer updates.
The miniature (``experiments/mini``) writes the same format with one line per optimizer update, and says so in
every line: ``mini/optimizer_step`` equals the line's ``step`` (and ``mini/reuse`` is N). :func:`log_step` reads
that marker, so a log is never read with the wrong step unit, manifest or not.

A run killed mid-write leaves a truncated last line, and NaN metrics arrive as ``null``: both are expected and
reported, not fatal. Anything else malformed is skipped with its line number, never guessed at: a line that is not
JSON (or nested too deep, or holds a number of more digits than Python reads), a ``step`` that is not an integer in
0..:data:`MAX_STEP`, a value too large for a float, a resume line whose attempt is not a positive integer.

A resumed run appends to its log after a line ``{"event": "resume", "attempt": k}`` (the respo-verl trainer's file
logger). Steps logged again by a later attempt (those after the checkpoint it resumed from) are counted once, the
latest attempt's line kept; :attr:`RunLog.continuity` says so, and says when the log does not start at step 1 or
skips steps (a log truncated by an older logger, or pieces of two runs), so that a reader never takes such a log
for a complete run (:meth:`RunLog.complete_through`). A plain reader of the file sees such a step twice: the line
that counts is the last one, the one after the latest resume line.

A run guard of the respo-verl trainer that stops a run logs the step it stops in with ``respo_verl/stopped`` = 1
(:data:`STOPPED_KEY`): :attr:`RunLog.stopped_at` is that step, unless a later line (a relaunch) went on from it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

# The line a resumed attempt's file logger writes first (respo_verl.patches.verl_0_9_1.RESUME_EVENT).
RESUME_EVENT = "resume"
# What the ``step`` of a line counts: a training step (one rollout batch, N updates) or one optimizer update.
LOG_STEPS = ("training", "optimizer")
# Logged on every line of a per-update log, equal to the line's step.
OPTIMIZER_STEP_KEY = "mini/optimizer_step"
# Logged on every line of a per-update log: N of the run.
REUSE_KEY = "mini/reuse"
# 1.0 on the line of the step a run guard stopped the run in (respo_verl.run.guards.STOPPED_KEY).
STOPPED_KEY = "respo_verl/stopped"
# Warnings of the run guards set to warn, counted from the run's first step (respo_verl.run.guards.WARNINGS_KEY):
# the sum under this key, each guard's under WARNINGS_KEY/<guard>.
WARNINGS_KEY = "respo_verl/guard_warnings"
# The largest step read: the paper's runs log at most 1024 steps, so a step beyond this is a damaged or forged line
# (and every step is kept in memory, so an unbounded one is not taken).
MAX_STEP = 10_000_000
# Gaps named in a continuity note; the rest are counted.
MAX_GAPS_NAMED = 10


class LogError(ValueError):
    """A log that cannot be read as declared (one line naming the file and what is wrong)."""


@dataclass
class RunLog:
    """Metrics of one run, by logged step.

    Attributes:
        path: the log file.
        metrics: metric name -> {step: value}; only finite numbers.
        skipped: human-readable notes on every line or value that was not used.
        continuity: notes on the sequence of logged steps: a first step other than 1, gaps, steps logged by more than
            one attempt (and which attempt's line was kept).
        attempts: how many attempts wrote the log (1 + its resume lines).
        stopped_at: the step a run guard stopped the run in (its line carries :data:`STOPPED_KEY`), when no later line
            follows it; None otherwise.
    """

    path: Path
    metrics: dict[str, dict[int, float]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    continuity: list[str] = field(default_factory=list)
    attempts: int = 1
    stopped_at: int | None = None

    def complete_through(self, last: int) -> bool:
        """Whether every step 1..``last`` was logged (no late start, no gap up to ``last``)."""
        return last >= 1 and sum(1 for step in self.steps if 1 <= step <= last) == last

    @property
    def steps(self) -> list[int]:
        return sorted({s for series in self.metrics.values() for s in series})

    @property
    def last_step(self) -> int:
        steps = self.steps
        return steps[-1] if steps else 0

    def series(self, key: str) -> dict[int, float]:
        return self.metrics.get(key, {})

    @property
    def warnings(self) -> dict[str, int]:
        """Warnings of each run guard set to warn, as its count on the last line that has one (none: ``{}``)."""
        prefix = f"{WARNINGS_KEY}/"
        return {
            key[len(prefix) :]: int(series[max(series)])
            for key, series in self.metrics.items()
            if key.startswith(prefix) and series
        }


def read_log(path: Path) -> RunLog:
    """Parse one file-logger log.

    Raises:
        LogError: when the file cannot be read or nothing usable is in it.
    """
    path = Path(path)
    run = RunLog(path)
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as exc:
        raise LogError(f"{path}: cannot read the log ({exc.strerror or exc})") from None
    if lines and lines[-1] == b"":
        lines.pop()
    attempt = 1
    written_by: dict[int, int] = {}  # step -> the attempt whose line is kept
    repeated: dict[int, list[int]] = {}  # step -> every attempt that logged it
    for lineno, raw in enumerate(lines, start=1):
        where = f"{path.name}:{lineno}"
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # ValueError: JSONDecodeError, too many digits
            truncated = lineno == len(lines) and not raw.rstrip().endswith(b"}")
            run.skipped.append(f"{where}: {'truncated last line' if truncated else 'not JSON'} ({str(exc)[:120]})")
            continue
        if isinstance(record, dict) and record.get("event") == RESUME_EVENT:
            given = record.get("attempt")
            if given is None:
                attempt += 1
            elif isinstance(given, int) and not isinstance(given, bool) and 1 <= given <= MAX_STEP:
                attempt = given
            else:
                run.skipped.append(f"{where}: resume line with attempt {str(given)[:40]!r}, not a positive integer")
                attempt += 1
            run.attempts = max(run.attempts, attempt)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("data"), dict):
            run.skipped.append(f"{where}: not a file-logger record (expected {{'step': int, 'data': {{...}}}})")
            continue
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            run.skipped.append(f"{where}: step {str(step)[:40]!r} is not an integer in 0..{MAX_STEP}")
            continue
        if step in written_by and written_by[step] != attempt:
            repeated.setdefault(step, [written_by[step]]).append(attempt)
        written_by[step] = attempt
        run.stopped_at = step if record["data"].get(STOPPED_KEY) == 1 else None
        for key, value in record["data"].items():
            if value is None:
                run.skipped.append(f"{where}: {key} is null (NaN when logged)")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue  # strings and lists (e.g. config dumps) are not metrics
            try:
                number = float(value)
            except OverflowError:
                run.skipped.append(f"{where}: {key} is an integer too large for a float")
                continue
            if not math.isfinite(number):
                run.skipped.append(f"{where}: {key} = {value}")
                continue
            series = run.metrics.setdefault(key, {})
            if step in series and step not in repeated:
                run.skipped.append(f"{where}: step {step} of {key} logged twice; the later value is used")
            series[step] = number
    if not run.metrics:
        raise LogError(f"{path}: no usable metric lines ({len(run.skipped)} skipped: {run.skipped[:3]})")
    run.continuity = _continuity(run.steps, repeated, written_by)
    if run.stopped_at is not None:
        run.continuity.append(f"stopped by a run guard in step {run.stopped_at} (its line has {STOPPED_KEY} = 1)")
    warned = run.warnings
    if warned:
        counts = ", ".join(f"{guard} {count}" for guard, count in sorted(warned.items()))
        first = min(run.series(WARNINGS_KEY))
        run.continuity.append(f"a run guard set to warn warned from step {first} on ({counts} warnings)")
    return run


def _ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    parts, start = [], None
    for i, step in enumerate(steps):
        if start is None:
            start = step
        if i + 1 == len(steps) or steps[i + 1] != step + 1:
            parts.append(f"{start}" if start == step else f"{start}-{step}")
            start = None
    return ", ".join(parts)


def _continuity(steps: list[int], repeated: dict[int, list[int]], written_by: dict[int, int]) -> list[str]:
    notes: list[str] = []
    steps = [s for s in steps if s >= 1]  # step 0 holds validation before training, when there is one
    if not steps:
        return notes
    if steps[0] > 1:
        first_missing = "1" if steps[0] == 2 else f"1-{steps[0] - 1}"
        notes.append(f"starts at step {steps[0]}, not 1: steps {first_missing} are missing")
    gaps = [(a + 1, b - 1) for a, b in pairwise(steps) if b > a + 1]  # from the sorted steps, never a range
    if gaps:
        named = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in gaps[:MAX_GAPS_NAMED])
        more = f" (and {len(gaps) - MAX_GAPS_NAMED} more gaps)" if len(gaps) > MAX_GAPS_NAMED else ""
        notes.append(f"gap: steps {named}{more} are missing")
    if repeated:
        steps_again = sorted(repeated)
        kept = sorted({written_by[s] for s in steps_again})
        notes.append(
            f"steps {_ranges(steps_again)} were logged by more than one attempt (attempts "
            f"{sorted({a for s in steps_again for a in repeated[s]})}); each is counted once, the line of attempt "
            f"{', '.join(map(str, kept))} kept"
        )
    return notes


def log_step(run: RunLog, declared: str | None = None) -> str:
    """What the ``step`` of ``run``'s lines counts: ``training`` or ``optimizer`` (see the module docstring).

    Args:
        run: the log.
        declared: what the manifest says, if there is one.

    Raises:
        LogError: when the log's own marker contradicts itself or the manifest.
    """
    if declared is not None and declared not in LOG_STEPS:
        raise LogError(f"{run.path}: log_step must be one of {LOG_STEPS}, got {declared!r}")
    marker = run.series(OPTIMIZER_STEP_KEY)
    if not marker:
        return declared or "training"
    wrong = [step for step, value in marker.items() if value != step]
    if wrong:
        step = wrong[0]
        raise LogError(
            f"{run.path}: {OPTIMIZER_STEP_KEY} = {marker[step]:g} on the line of step {step}; "
            "a per-update log has them equal, so the step unit of this log is unknown"
        )
    if declared == "training":
        raise LogError(
            f"{run.path}: the manifest says one line per training step, but the log has one line per optimizer "
            f"update ({OPTIMIZER_STEP_KEY})"
        )
    return "optimizer"


def logged_reuse(run: RunLog) -> int | None:
    """N as a per-update log records it (``mini/reuse``), or None; LogError when it changes within the log."""
    values = set(run.series(REUSE_KEY).values())
    if not values:
        return None
    if len(values) > 1 or not float(next(iter(values))).is_integer():
        raise LogError(f"{run.path}: {REUSE_KEY} takes several or non-integer values: {sorted(values)}")
    return int(next(iter(values)))
