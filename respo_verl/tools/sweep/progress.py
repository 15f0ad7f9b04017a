"""The progress line of a sweep: run i of n, its step s of S, the sweep's steps, elapsed and remaining time.

One tqdm line, redrawn in place on a terminal; where the output is not a terminal (a file, a CI log, ``nohup``) each
refresh is one printed line, written when something changed (a new step, another run) and at least every
:data:`QUIET_REFRESH_S` seconds. The remaining time is tqdm's estimate from the steps finished since the sweep
started (start-up of each run included, so it is pessimistic early in a run and right on average over runs).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

from respo_verl.tools.runs.manifest import RunRecord

BAR_FORMAT = "{desc} | {n_fmt} of {total_fmt} steps of the sweep | {elapsed} elapsed, ~{remaining} left"
# A non-terminal gets a line at least this often, so that a log shows the sweep is alive during a run's start-up.
QUIET_REFRESH_S = 60.0


class SweepProgress:
    """Progress over the training steps of every run of a sweep.

    Args:
        records: the runs of the sweep, whose planned steps are its total.
        done_steps: those already logged when the sweep starts (complete runs, the logged part of partial ones);
            the remaining time is estimated from the steps made after them.
        stream: where the line goes (default stdout).
        interactive: redraw in place; default: whether ``stream`` is a terminal.
    """

    def __init__(
        self, records: list[RunRecord], done_steps: int, stream: TextIO | None = None, interactive: bool | None = None
    ) -> None:
        self.stream = sys.stdout if stream is None else stream
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.total, self.initial, self.runs = sum(r.last_log_step for r in records), done_steps, len(records)
        self.done = done_steps
        self.desc = f"{self.runs} runs"
        self.started = time.monotonic()
        self._printed: tuple[str, int] | None = None
        self._printed_at = 0.0
        self._bar = (
            tqdm(total=self.total, initial=done_steps, bar_format=BAR_FORMAT, file=self.stream, desc=self.desc)
            if self.interactive
            else None
        )

    def update(self, index: int, name: str, step: int, steps: int, sweep_done: int) -> None:
        """Run ``index`` (1-based) named ``name`` is at ``step`` of ``steps``; ``sweep_done`` steps of the sweep are
        logged in all."""
        self.show(f"run {index} of {self.runs}: {name}, step {step} of {steps}", sweep_done)

    def show(self, desc: str, sweep_done: int) -> None:
        """Any description (the Ray executor's: runs done, running, failed) and the sweep's logged steps."""
        self.desc, self.done = desc, sweep_done
        self.refresh()

    def drop(self, steps: int) -> None:
        """Leave out ``steps`` that will not be made in this sweep (those a failed run did not log)."""
        self.total = max(self.total - steps, self.done)
        if self._bar is not None:
            self._bar.total = self.total

    def line(self) -> str:
        return tqdm.format_meter(
            n=self.done,
            total=self.total,
            elapsed=time.monotonic() - self.started,
            prefix=self.desc,
            bar_format=BAR_FORMAT,
            initial=self.initial,
        )

    def refresh(self) -> None:
        if self._bar is not None:
            self._bar.set_description_str(self.desc, refresh=False)
            self._bar.n = self.done
            self._bar.refresh()
            return
        now = time.monotonic()
        state = (self.desc, self.done)
        if state != self._printed or now - self._printed_at >= QUIET_REFRESH_S:
            print(self.line(), file=self.stream, flush=True)
            self._printed, self._printed_at = state, now

    def write(self, message: str) -> None:
        """A message of the sweep, on its own lines (above the progress line on a terminal)."""
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
