"""The local executor of ``respo-verl sweep --out DIR``: the sweep's runs one after another on this machine.

Each run's output goes to ``<name>.out`` beside its log (:func:`output_path`), a failed run is reported
(:func:`failure_report`) and the sweep goes on, an interrupt makes the running run save and stop, and the folder is
locked (:data:`LOCK_NAME`) while the sweep or its run lives. How, and why:
docs/internals.md, "The sweep run here: progress, interruption, locks".
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import psutil

from respo_verl.tools.runs.logs import LogError, read_log
from respo_verl.tools.runs.manifest import RunRecord
from respo_verl.tools.sweep.progress import SweepProgress
from respo_verl.tools.sweep.runner import Outcome, Status, is_complete, local_command, log_path, shell_line

LOCK_NAME = "sweep.lock"
# Lines of a failed run's output shown in its report; characters kept of each (Ray prints very long lines).
TAIL_LINES = 20
TAIL_WIDTH = 400
POLL_S = 1.0


class SweepBusy(RuntimeError):
    """Another sweep runs in the folder (one line; exit status 2)."""


def output_path(record: RunRecord, out_dir: Path) -> Path:
    """Where the run's stdout and stderr go: ``<name>.out`` beside its log."""
    return log_path(record, out_dir).with_suffix(".out")


def logged_steps(record: RunRecord, out_dir: Path) -> int:
    """How many of the run's planned steps (1..last) its log holds."""
    path = log_path(record, out_dir)
    if not path.is_file():
        return 0
    try:
        steps = read_log(path).steps
    except LogError:
        return 0
    return sum(1 for step in steps if 1 <= step <= record.last_log_step)


def _write_holder(fd: int, holder: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)


def _open_lock(path: Path) -> int:
    """Open (or create) the lock file itself: never through a symbolic link (whose target the holder line would
    overwrite), and only a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if path.is_symlink():
            raise SweepBusy(f"{path} is a symbolic link; the sweep writes its lock through none: remove it") from None
        raise SweepBusy(f"cannot open {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SweepBusy(f"{path} is not a regular file; remove it")
    return fd


def _holder(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


@contextmanager
def folder_lock(out_dir: Path, echo, wait: bool = True) -> Iterator[int]:
    """Hold ``out_dir/sweep.lock`` (see the module docstring); yields its file descriptor, which a run inherits.

    With ``wait`` (a sweep that runs), a lock held only by the run of a stopped sweep is waited for; without it
    (``--force``, which moves files) any holder refuses.

    Raises:
        SweepBusy: a live sweep holds it (or, without ``wait``, any process does), or it is not a regular file.
    """
    path = out_dir / LOCK_NAME
    fd = _open_lock(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            sweep_pid = holder.get("sweep_pid")
            if isinstance(sweep_pid, int) and psutil.pid_exists(sweep_pid):
                raise SweepBusy(
                    f"another sweep (pid {sweep_pid}) is running in {out_dir}; wait for it or stop it"
                ) from None
            if not wait:
                raise SweepBusy(
                    f"{path} is held by run {holder.get('run', '?')} (pid {holder.get('run_pid', '?')}) of a stopped "
                    "sweep, which saves at the end of its current step: --force moves nothing until it has ended"
                ) from None
            echo(
                f"waiting for run {holder.get('run', '?')} (pid {holder.get('run_pid', '?')}) of a sweep that was "
                f"stopped to end: it saves at the end of its current step ({path} is held until then)"
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        _write_holder(fd, {"sweep_pid": os.getpid()})
        yield fd
    finally:
        os.close(fd)


class _Interrupts:
    """SIGINT/SIGTERM of the sweep: the first asks the running run to save and stop (SIGTERM), a second kills it."""

    def __init__(self, echo) -> None:
        self.echo = echo
        self.messages: list[str] = []  # written by the handler, printed by the sweep's loop (print is not reentrant)
        self.signum: int | None = None
        self.child: subprocess.Popen | None = None
        self.run = ""
        self._term: list[subprocess.Popen] = []
        self._saved: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed there; the caller's own handling applies
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._saved[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)

    def attach(self, child: subprocess.Popen, run: str) -> None:
        """From now on an interrupt stops ``child``; one that came before (between the sweep's last look and the
        start of ``child``) stops it now."""
        self._term = [child]  # taken by exactly one of attach and _handle: list.pop is atomic for a signal handler
        self.child, self.run = child, run
        if self.signum is not None:
            self._stop(self.signum)

    def detach(self) -> None:
        self.child, self._term = None, []

    def _stop(self, signum: int) -> None:
        try:
            child = self._term.pop()
        except IndexError:
            return  # already asked to stop, or no run
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            self.messages.append(
                f"{signal.Signals(signum).name}: stopping {self.run}, which saves at the end of its current step "
                "(interrupt again to kill it now); run the same command to resume"
            )

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self._stop(signum)
            return
        child = self.child
        if child is not None and child.poll() is None:
            child.kill()
            self.messages.append(f"{signal.Signals(signum).name} again: killed {self.run}")

    def flush(self) -> None:
        while self.messages:
            self.echo(self.messages.pop(0))


# The run's first program, in place of a pre-exec function (which is unsafe once the progress bar's thread runs):
# it asks the kernel for SIGTERM when the sweep dies (PR_SET_PDEATHSIG, kept across exec), ends at once when the
# sweep died before that, and then becomes the run (exec, same pid). Stdlib only, so that it takes milliseconds.
_START_RUN = """
import ctypes, ctypes.util, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass  # no prctl (not Linux): the sweep's own handlers still stop the run
if os.getppid() != parent:
    sys.exit(128 + signal.SIGTERM)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def start_command(command: list[str], parent: int) -> list[str]:
    """``command`` started through :data:`_START_RUN`, which ties it to the sweep ``parent``."""
    return [sys.executable, "-c", _START_RUN, str(parent), *command]


def _ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _read_from(path: Path, offset: int) -> str:
    with path.open("rb") as fh:
        fh.seek(offset)
        return fh.read().decode(errors="replace")


def failure_report(
    record: RunRecord, how: str, logged: int, text: str, output: Path, source: str = "its output"
) -> str:
    """The report of a failed run (both executors'): its name, how it ended, the last lines of ``text`` (its output,
    as ``source`` names it), and ``output``, the file that holds all of it."""
    tail = [line[:TAIL_WIDTH] for line in text.splitlines() if line.strip()][-TAIL_LINES:]
    lines = [f"run {record.name} failed: {how}, {logged} of {record.last_log_step} steps logged"]
    lines += [f"  the last lines of {source}:", *(f"  | {line}" for line in tail)] if tail else ["  no output"]
    lines.append(f"  full output: {output}")
    return "\n".join(lines)


def _run_one(
    index: int,
    record: RunRecord,
    out_dir: Path,
    lock_fd: int,
    interrupts: _Interrupts,
    progress: SweepProgress,
    others_done: int,
) -> Outcome:
    output = output_path(record, out_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    steps = record.last_log_step
    with output.open("ab") as fh:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        fh.write(f"=== respo-verl sweep, {stamp}: {shell_line(record)}\n".encode())
        fh.flush()
        offset_run = fh.tell()
        progress.write(f"run {index} of {progress.runs}: {record.name} (output: {output})")
        process = subprocess.Popen(
            start_command(local_command(record), os.getpid()),
            env={**os.environ, **record.env},
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C at the terminal reaches the sweep, which stops the run in order
            pass_fds=(lock_fd,),
        )
    interrupts.attach(process, record.name)
    _write_holder(lock_fd, {"sweep_pid": os.getpid(), "run": record.name, "run_pid": process.pid})
    while process.poll() is None:
        interrupts.flush()
        logged = logged_steps(record, out_dir)
        progress.update(index, record.name, logged, steps, others_done + logged)
        time.sleep(POLL_S)
    interrupts.detach()
    logged = logged_steps(record, out_dir)
    progress.update(index, record.name, logged, steps, others_done + logged)
    interrupts.flush()
    if is_complete(record, out_dir):
        return Outcome(record.name, Status.RAN, f"ran: {steps} steps logged")
    how = _ended(process.returncode)
    if interrupts.signum is not None:
        return Outcome(
            record.name,
            Status.INTERRUPTED,
            f"interrupted ({how}) with {logged} of {steps} steps logged; the same command resumes it",
        )
    progress.write(failure_report(record, how, logged, _read_from(output, offset_run), output))
    progress.drop(steps - logged)
    return Outcome(record.name, Status.FAILED, f"failed: {how}, {logged} of {steps} steps logged")


def run_locally(records: list[RunRecord], out_dir: Path, stream=None, interactive: bool | None = None) -> list[Outcome]:
    """Run the incomplete runs of ``records`` one after another (see the module docstring); one :class:`Outcome` per
    run started or skipped. The outcomes end at an interrupted run.

    Raises:
        SweepBusy: another sweep runs in ``out_dir``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    logged = {r.name: logged_steps(r, out_dir) for r in records}
    progress = SweepProgress(records, sum(logged.values()), stream, interactive)
    interrupts = _Interrupts(progress.write)
    outcomes: list[Outcome] = []
    try:
        with folder_lock(out_dir, progress.write) as lock_fd:
            interrupts.install()
            for index, record in enumerate(records, start=1):
                if interrupts.signum is not None:
                    break
                if is_complete(record, out_dir):
                    outcomes.append(Outcome(record.name, Status.SKIPPED, "skipped: log complete"))
                    progress.write(f"run {index} of {len(records)}: {record.name} skipped, its log is complete")
                    continue
                others = sum(logged_steps(r, out_dir) for r in records if r.name != record.name)
                outcome = _run_one(index, record, out_dir, lock_fd, interrupts, progress, others)
                outcomes.append(outcome)
                if outcome.status is not Status.FAILED:
                    progress.write(f"run {index} of {len(records)}: {record.name} {outcome.line}")
    finally:
        interrupts.restore()
        progress.close()
    return outcomes


def summary(outcomes: list[Outcome], planned: int) -> str:
    """The sweep's last line: ``7 done, 1 failed: <name>`` (and what was interrupted or not started)."""
    done = sum(o.status in (Status.RAN, Status.SKIPPED) for o in outcomes)
    failed = [o.name for o in outcomes if o.status is Status.FAILED]
    text = f"{done} done"
    if failed:
        text += f", {len(failed)} failed: {', '.join(failed)}"
    interrupted = [o.name for o in outcomes if o.status is Status.INTERRUPTED]
    if interrupted:
        text += f", interrupted: {', '.join(interrupted)}"
    if planned > len(outcomes):
        text += f", {planned - len(outcomes)} not started"
    return text
