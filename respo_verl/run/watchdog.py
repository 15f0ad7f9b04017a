"""The watchdog: the driver's one watch over the phases of a run's steps, and the SIGTERM stop request.

The trainer keeps a phase record (:class:`PhaseBoard`) in the Ray cluster's key-value store (:class:`Records`, under
the job's id); the driver's :class:`Watchdog` holds it against one bound per phase (``run_guard``,
:class:`respo_verl.run.guards.GuardConfig`) by its own clock and asks no actor. How, and why these bounds:
docs/internals.md, "The watchdog: a step or a phase that makes no progress".
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ray

from respo_verl.patches import ray_private
from respo_verl.run.guards import GuardConfig
from respo_verl.run.liveness import BETWEEN_PHASES
from respo_verl.run.nodes import CLUSTER_CHECK_INTERVAL_S, ClusterWatch
from respo_verl.run.roles import SAMPLE_PHASES, VALIDATION
from respo_verl.run.stops import PhaseStalled, RunStopped, StalledAfterStop, StepStalled

# Ray's key-value namespace of the records; each run's keys start with its Ray job id.
RECORD_NAMESPACE = "respo_verl"
PHASE, STOP = "phase", "stop"  # the trainer's phase record, the driver's stop request
# How often the driver reads the phase record: a phase past its bound stops the run at most this much later. The
# folder of a save in progress is measured as often.
PHASE_CHECK_INTERVAL_S = 2.0
# The stages of a run's set-up are phases named ``set-up (<stage>)``: their progress is a new stage or a new actor of
# the run, their bound run_guard.max_setup_s. Before the trainer's first record, the TaskRunner starts.
SETUP = "set-up"
FIRST_STAGE = "the TaskRunner starts: verl, TransferQueue"


def setup_phase(stage: str) -> str:
    return f"{SETUP} ({stage})"


class Records:
    """A run's records (JSON objects) in the Ray cluster's key-value store, under ``job_id`` (default: the job of
    the calling process: the driver and the actors it starts share it). Needs a connected Ray."""

    def __init__(self, job_id: str | None = None) -> None:
        self.prefix = f"{job_id or ray.get_runtime_context().get_job_id()}/"

    def put(self, name: str, value: dict[str, Any]) -> None:
        ray_private.kv_put(self.prefix + name, json.dumps(value), RECORD_NAMESPACE)

    def get(self, name: str) -> dict[str, Any] | None:
        raw = ray_private.kv_get(self.prefix + name, RECORD_NAMESPACE)
        return None if raw is None else json.loads(raw)

    def delete(self, name: str) -> None:
        ray_private.kv_del(self.prefix + name, RECORD_NAMESPACE)


def folder_bytes(folder: str | None) -> int:
    """Bytes of the files under ``folder`` (a ``stat`` per file); 0 when there is none."""
    total = 0
    for root, _, names in os.walk(folder or ""):
        for name in names:
            with contextlib.suppress(OSError):  # a file the save renames or removes while it is counted
                total += os.stat(os.path.join(root, name)).st_size
    return total


class PhaseBoard:
    """The trainer's side of the watchdog: the phase record, rewritten whole on each change (a phase begins or
    ends, a poll of the sample wait, the folder being saved grew). ``seq`` counts the changes that are progress;
    ``detail`` (the sample wait's counts) may change without progress. Without ``records`` (a run without the
    watchdog, ``run_guard.enable=false``) it records nothing."""

    def __init__(self, records: Records | None = None) -> None:
        self.records = records
        self.current: dict[str, Any] = {}
        self.seq = 0
        self._lock = threading.Lock()

    def enter(self, step: int, phase: str, waits_on: str) -> None:
        self._write({"watched": True, "step": int(step), "phase": phase, "waits_on": waits_on}, advanced=True)

    def pause(self, why: str) -> None:
        """No bound until the next phase begins: between the trainer's start-up and its first step (verl builds the
        agent loop then), and once training has ended."""
        self._write({"watched": False, "why": why}, advanced=True)

    def progress(self, detail: str | None = None, advanced: bool = True) -> None:
        """The phase goes on; ``advanced``: it made progress; ``detail``: what it waits for, as of now."""
        if self.current.get("watched") and (advanced or detail != self.current.get("detail")):
            self._write({**self.current, "detail": detail}, advanced)

    @contextmanager
    def phase(self, step: int, phase: str, waits_on: str, folder: str | None = None) -> Iterator[None]:
        """Run ``phase`` of ``step``; with ``folder``, a save: each growth of its bytes is progress."""
        self.enter(step, phase, waits_on)
        done = threading.Event()
        if folder is not None and self.records is not None:
            size = folder_bytes(folder)

            def measure() -> None:
                nonlocal size
                while not done.wait(PHASE_CHECK_INTERVAL_S):
                    size, before = folder_bytes(folder), size
                    if size != before:
                        self.progress()

            threading.Thread(target=measure, name="respo-verl save progress", daemon=True).start()
        try:
            yield
        finally:
            done.set()
            self.enter(step, f"between phases, after {phase}", BETWEEN_PHASES)

    def _write(self, record: dict[str, Any], advanced: bool) -> None:
        with self._lock:
            self.seq += advanced
            self.current = record
            if self.records is not None:
                self.records.put(PHASE, {**record, "seq": self.seq, "pid": os.getpid()})


class Watchdog:
    """The driver's side (module docstring); with ``guard.enable`` false it only carries the stop request to the
    trainer. ``trace``: a file to which each changed record is appended, as a JSON line with ``at``, the driver's
    monotonic clock (the entry point's ``RESPO_VERL_WATCHDOG_TRACE``: what the watchdog saw of a hang)."""

    def __init__(
        self,
        records: Records,
        guard: GuardConfig,
        clock: Callable[[], float] = time.monotonic,
        trace: str | None = None,
        cluster: ClusterWatch | None = None,
    ) -> None:
        """``cluster``: the look at the run's nodes and set-up actors (:class:`respo_verl.run.nodes.ClusterWatch`),
        every :data:`respo_verl.run.nodes.CLUSTER_CHECK_INTERVAL_S`; None: the record alone."""
        self.records, self.guard, self.clock, self.trace, self.cluster = records, guard, clock, trace, cluster
        self._next_look = clock()
        self.stopped: RunStopped | None = None
        # the step of the last record read that named one (a record of the trainer's end names none), or None
        self.step: int | None = None
        self._record: dict[str, Any] | None = None
        self._changed_at = clock()
        self._stop_at: float | None = None
        self._stop_sent = False
        self._wake, self._done = threading.Event(), threading.Event()

    def request_stop(self) -> None:
        """SIGTERM: ask the trainer to save at the end of its step (sent from the watchdog's thread: a signal
        handler must not call into Ray), and bound what is left by ``run_guard.max_stall_after_stop_s``."""
        if self._stop_at is None:
            self._stop_at = self.clock()
        self._wake.set()

    def check(self) -> RunStopped | None:
        """The stop the record calls for now, or None."""
        now = self.clock()
        try:
            record = self.records.get(PHASE)
        except Exception:  # Ray unreachable for a moment: the last record read stands
            record = self._record
        if (record or {}).get("seq") != (self._record or {}).get("seq"):
            self._changed_at = now
            if self.trace and record is not None:
                with open(self.trace, "a") as out:
                    out.write(json.dumps({"at": now, **record}) + "\n")
        self._record = record
        self.step = (record or {}).get("step", self.step)
        phase = (record or {}).get("phase", setup_phase(FIRST_STAGE)) if (record or {}).get("watched", True) else None
        setup = phase is not None and phase.startswith(SETUP)
        if self.cluster is not None and now >= self._next_look:
            self._next_look = now + CLUSTER_CHECK_INTERVAL_S
            try:
                stop, grew = self.cluster.look(phase if setup else f"step {self.step}", setup)
            except Exception:  # Ray unreachable for a moment: the next look asks again
                stop, grew = None, False
            if stop is not None:
                return stop
            if grew and setup:
                self._changed_at = now
        if phase is None:
            return None
        record = record or {"phase": phase, "waits_on": "the trainer (TaskRunner)"}
        if self._stop_at is not None:
            quiet = now - max(self._changed_at, self._stop_at)
            if quiet > self.guard.max_stall_after_stop_s:
                return self.stop_for(record, quiet, after_stop=True)
        quiet = now - self._changed_at
        key = "max_setup_s" if setup else "max_stall_s" if phase in SAMPLE_PHASES else "max_phase_s"
        return self.stop_for(record, quiet) if quiet > getattr(self.guard, key) else None

    def latest_step(self) -> int | None:
        """The step of the record as it stands now, for a stop line: the last check may be an interval old, and a
        node lost just after a step ended would otherwise be said lost in that step. The last step read stands when
        Ray cannot answer."""
        with contextlib.suppress(Exception):
            self.step = (self.records.get(PHASE) or {}).get("step", self.step)
        return self.step

    def stop_for(self, record: dict[str, Any], quiet: float, after_stop: bool = False) -> RunStopped:
        """The one line of a stop: ``record``'s phase, quiet for ``quiet`` seconds past its bound."""
        step, phase, waits = record.get("step"), record.get("phase"), f"it waits on {record.get('waits_on')}"
        samples = phase in SAMPLE_PHASES
        wait = f"the step waited for its {VALIDATION if phase == VALIDATION else 'train'} samples"
        state = f" ({record['detail']})" if record.get("detail") else ""
        if after_stop:
            bound = f"run_guard.max_stall_after_stop_s={self.guard.max_stall_after_stop_s:g}"
            if phase.startswith(SETUP):
                return StalledAfterStop(
                    f"{phase}: stop requested (SIGTERM), and no new stage and no new actor of the run for "
                    f"{quiet:.1f} s after it > {bound}; {waits}: ended before its first step"
                )
            if samples:
                return StalledAfterStop(
                    f"step {step}: stop requested (SIGTERM) while {wait}, and no sample finished for {quiet:.0f} s "
                    f"after it{state} > {bound}: ended without saving step {step} (its update has not run); a "
                    "relaunch resumes from the last checkpoint"
                )
            return StalledAfterStop(
                f"step {step}: stop requested (SIGTERM) during the phase '{phase}', and no phase ended and no progress "
                f"for {quiet:.1f} s after it > {bound}; {waits}: ended without saving step {step}; a relaunch resumes "
                "from the last checkpoint"
            )
        if samples:
            return StepStalled(
                f"step {step}: no sample finished for {quiet:.0f} s while {wait}{state} > "
                f"run_guard.max_stall_s={self.guard.max_stall_s:g}"
            )
        if phase.startswith(SETUP):
            return PhaseStalled(
                f"{phase}: no new stage and no new actor of the run for {quiet:.1f} s > "
                f"run_guard.max_setup_s={self.guard.max_setup_s:g}; {waits}"
            )
        return PhaseStalled(
            f"step {step}: the phase '{phase}' has run for {quiet:.1f} s with no progress > "
            f"run_guard.max_phase_s={self.guard.max_phase_s:g}; {waits}"
        )

    def start(self, on_stop: Callable[[], None]) -> threading.Thread:
        """Watch in a daemon thread until :meth:`close`; on a stop, keep it in :attr:`stopped` and call ``on_stop``
        (the entry point interrupts its main thread, which waits in ``ray.get`` for the trainer)."""

        def loop() -> None:
            while not self._done.is_set():
                self._wake.wait(PHASE_CHECK_INTERVAL_S)
                self._wake.clear()
                if self._stop_at is not None and not self._stop_sent:
                    self.records.put(STOP, {"signal": "SIGTERM"})
                    self._stop_sent = True
                stop = self.check() if self.guard.enable else None
                if stop is not None:
                    self.stopped = stop
                    on_stop()
                    return

        thread = threading.Thread(target=loop, name="respo-verl watchdog", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._done.set()
        self._wake.set()
