"""Ray's processes of a local cluster end with the driver that started them, however the driver ends.

:func:`watch_driver` starts the reaper, ``python -m respo_verl.run.reaper``, in a session of its own (a kill of the
driver's process group does not reach it). It records the driver's process tree while the driver lives (:func:`watch`)
and stops what is left once the driver has ended (:func:`reap`), within :data:`REAP_BOUND_S`; never a cluster the
driver connected to through an address, anything outside the driver's process tree and the session's folder, or a
process of another user. Linux only (the terminal's foreground group is read from ``/proc``). Why (what Ray's own
fate sharing leaves behind), and the tests: docs/internals.md, "The respo-verl trainer and its checkpoints".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

# How often the reaper checks whether the driver is still there: the first term of the bound.
DEATH_POLL_S = 0.25
# How often it records the driver's process tree; a process started and orphaned within one interval before the
# driver's death is still found through the session folder on its command line or through a recorded ancestor.
SCAN_INTERVAL_S = 2.0
# SIGTERM lets raylet and workers end their children; what has not ended by then gets SIGKILL.
TERM_GRACE_S = 3.0
# How long a SIGKILLed process may take to disappear (a kernel that is slow to reap a large process).
KILL_WAIT_S = 5.0
# The promise: no process of the session is left this many seconds after the driver's exit (by construction at
# most DEATH_POLL_S + TERM_GRACE_S + KILL_WAIT_S).
REAP_BOUND_S = 10.0

# Never stopped because their command line names the session folder: a user looking at a Ray log from a shell.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "fish", "tcsh", "csh", "busybox"})


def running(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs: not ended, not a zombie, its pid not reused by another process."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def find(pid: int, created: float | None = None) -> psutil.Process | None:
    """The running process ``pid`` (created at ``created``, when given), or None."""
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return None
    if created is not None and proc.create_time() != created:
        return None
    return proc if running(proc) else None


def _owned(proc: psutil.Process) -> bool:
    try:
        return proc.uids().effective == os.geteuid()
    except psutil.Error:
        return False


def _terminal(pid: int) -> tuple[int, int]:
    """The process's controlling terminal (0: none) and that terminal's foreground process group (-1: none)."""
    # psutil reads neither number (its terminal() finds a name in /dev, which a container may not have): fields 7
    # and 8 of /proc/<pid>/stat, after the command name in parentheses.
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[4]), int(fields[5])
    except (OSError, ValueError, IndexError):
        return 0, -1


def strange_by_folder(proc: psutil.Process) -> bool:
    """Whether a process whose command line names the session folder is still not the cluster's: a shell, or one
    that holds a terminal (the leader of a terminal's session, or a process in its foreground, what a user looks
    at). Ray's processes of a driver started at a terminal share that terminal, but not its foreground once the
    driver has ended. A process that cannot be read is left alone too."""
    try:
        if proc.name() in SHELLS:
            return True
        tty, foreground = _terminal(proc.pid)
        return tty != 0 and (os.getsid(proc.pid) == proc.pid or foreground == os.getpgid(proc.pid))
    except (psutil.Error, OSError):
        return True


def names_folder(proc: psutil.Process, folder: str) -> bool:
    """Whether an argument of ``proc``'s command line is ``folder``, ends in ``=folder`` or lies inside it."""
    try:
        args = proc.cmdline()
    except psutil.Error:
        return False
    name = folder.rstrip("/")
    return any(arg == name or arg.endswith("=" + name) or name + "/" in arg for arg in args)


def reap(recorded: Iterable[psutil.Process], session_dir: str | None) -> tuple[int, int]:
    """Stop the recorded processes still alive, those naming ``session_dir`` and all their descendants: SIGTERM,
    then SIGKILL for whatever is left after :data:`TERM_GRACE_S` or started meanwhile, all within
    :data:`TERM_GRACE_S` + :data:`KILL_WAIT_S`. Returns (processes stopped, of which by SIGKILL)."""
    recorded = list(recorded)
    me = os.getpid()
    stopped: dict[int, psutil.Process] = {}  # every process signalled, by pid
    killed: set[int] = set()

    def targets() -> dict[int, psutil.Process]:
        roots = [proc for proc in [*recorded, *stopped.values()] if running(proc)]
        if session_dir:
            roots += [p for p in psutil.process_iter() if names_folder(p, session_dir) and not strange_by_folder(p)]
        found: dict[int, psutil.Process] = {}
        for root in roots:
            if root.pid in found:  # already below another root: its subtree is in
                continue
            try:
                below = root.children(recursive=True)
            except psutil.Error:
                below = []
            found.update((proc.pid, proc) for proc in [root, *below])
        # Never this process, init, or another user's.
        return {pid: proc for pid, proc in found.items() if pid not in (me, 1) and _owned(proc) and running(proc)}

    def wait(procs: Iterable[psutil.Process], until: float) -> None:
        # Not psutil.wait_procs: it counts a zombie (ended, not yet reaped by its parent) as alive and waits it out.
        procs = list(procs)
        while time.monotonic() < until and any(running(proc) for proc in procs):
            time.sleep(0.05)

    began = time.monotonic()
    first = targets()
    stopped.update(first)
    for proc in first.values():
        _signal(proc, signal.SIGTERM)
    wait(first.values(), began + TERM_GRACE_S)
    for _ in range(3):  # a process may start another while it is stopped: look again, a bounded number of times
        left = {pid: proc for pid, proc in targets().items() if pid not in stopped or stopped[pid] == proc}
        if not left or time.monotonic() >= began + TERM_GRACE_S + KILL_WAIT_S:
            break
        stopped.update(left)
        for proc in left.values():
            _signal(proc, signal.SIGKILL)
        killed |= set(left)
        wait(left.values(), began + TERM_GRACE_S + KILL_WAIT_S)
    return len(stopped), len(killed)


def _signal(proc: psutil.Process, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``proc``, never to another process that has its pid now; whether sent."""
    # psutil checks the creation time and then signals the pid, which the kernel may have reused in between; a pidfd
    # opened before that check holds the process itself (kernels before 5.3 have none: psutil's check alone).
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return False
    except (OSError, AttributeError):
        fd = None
    try:
        if not running(proc) or not _owned(proc):
            return False
        if fd is None:
            proc.send_signal(sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except (psutil.Error, ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def watch(driver: psutil.Process | None, session_dir: str | None) -> tuple[int, int]:
    """Record the driver's process tree until the driver has ended, then :func:`reap` (the reaper's body).

    Each process is kept as a ``psutil.Process``, its pid with its creation time: a pid the kernel has reused is
    never taken for one recorded.
    """
    recorded: dict[int, psutil.Process] = {}
    next_scan = 0.0
    while driver is not None and running(driver):
        if time.monotonic() >= next_scan:
            with contextlib.suppress(psutil.Error):
                recorded.update((proc.pid, proc) for proc in driver.children(recursive=True))
            next_scan = time.monotonic() + SCAN_INTERVAL_S
        time.sleep(DEATH_POLL_S)
    return reap(recorded.values(), session_dir)


def watch_driver(session_dir: str | None, driver_pid: int | None = None) -> subprocess.Popen:
    """Start the reaper for ``driver_pid`` (default: this process) and the Ray session folder ``session_dir``."""
    pid = os.getpid() if driver_pid is None else int(driver_pid)
    driver = find(pid)
    if driver is None:
        raise ValueError(f"no process {pid} to watch")
    command = [sys.executable, "-m", "respo_verl.run.reaper", str(pid), repr(driver.create_time())]
    if session_dir:
        command += ["--session-dir", str(session_dir)]
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True
    )


def _append_to_stderr_file() -> None:
    """A stderr that is a file the driver wrote with ``>`` (no O_APPEND) has the offset the driver left; whatever its
    caller appended after the driver's exit would be overwritten by the line below: write at the end instead."""
    import fcntl
    import stat

    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.fstat(2).st_mode):
            fcntl.fcntl(2, fcntl.F_SETFL, fcntl.fcntl(2, fcntl.F_GETFL) | os.O_APPEND)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m respo_verl.run.reaper", description=__doc__.split("\n")[0])
    parser.add_argument("driver_pid", type=int)
    parser.add_argument("driver_created", type=float, help="the driver's creation time, as psutil reads it")
    parser.add_argument("--session-dir", default=None, help="the Ray session folder the driver started")
    args = parser.parse_args(argv)
    # A Ctrl-C at the terminal, or SIGTERM (a save-and-stop request) sent to every process of a job, is for the
    # driver: the reaper ends by itself once the driver has ended and its cluster is stopped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stopped, killed = watch(find(args.driver_pid, args.driver_created), args.session_dir)
    if stopped:
        _append_to_stderr_file()
        session = f" and its Ray session {args.session_dir}" if args.session_dir else ""
        print(
            f"respo-verl reaper: driver {args.driver_pid} has ended; stopped {stopped} process(es) of its tree"
            f"{session} ({killed} by SIGKILL)",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
