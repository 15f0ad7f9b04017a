"""Ray's processes of a local cluster end with the driver that started them, however the driver ends.

``ray.init()`` without an address starts a Ray cluster of its own inside the driver (GCS, raylet, dashboard,
monitors), and the raylet starts the agents and the workers (verl's TaskRunner, FSDP/Megatron workers, rollout
servers and whatever they start, vLLM's engine processes among them). A driver that ends normally stops them
(``ray.shutdown``); one killed by SIGKILL (an out-of-memory kill, a pre-emption past its grace time) leaves them to
Ray's fate sharing, which ends GCS and raylet at once, but Ray's agents lived on for about a minute after such a kill
(measured: ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``, 40-70 s), and any process whose parent had not
ended with it stays until it notices.

:func:`watch_driver` starts the reaper, ``python -m respo_verl.run.reaper``, in a session of its own (a kill of the
driver's process group does not reach it). While the driver lives, the reaper records the driver's descendants
every :data:`SCAN_INTERVAL_S` seconds, each by pid and start time (a pid the kernel has reused is never taken for
one recorded). Once the driver has ended, it stops what is left of that cluster: the recorded processes still
alive, every process whose command line names the session's folder, and all their descendants; SIGTERM first, then
SIGKILL after :data:`TERM_GRACE_S`. Bound: every such process is gone :data:`REAP_BOUND_S` seconds after the
driver's exit at the latest (worst case by construction: :data:`DEATH_POLL_S` + :data:`TERM_GRACE_S` +
:data:`KILL_WAIT_S`). It never touches a cluster the driver connected to through an address (the entry point does
not start it then) nor anything outside the driver's process tree and the session's folder, and never a process of
another user: every target runs under the reaper's own uid. A process found only through the session's folder on
its command line is left alone when it is a shell or holds a terminal (:func:`strange_by_folder`: a user's
``less`` of a Ray log, an editor).
Signals go through a pidfd (Linux 5.3 and later) opened while the process is checked to be the one recorded, so a
pid the kernel reuses meanwhile is never signalled; elsewhere through the pid, checked just before.

Linux only (it reads ``/proc``); stdlib only, so that the reaper starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# How often the reaper checks whether the driver is still there: the first term of the bound.
DEATH_POLL_S = 0.25
# How often it records the driver's process tree; a process started and orphaned within one interval before the
# driver's death is still found through the session folder on its command line or through a recorded ancestor.
SCAN_INTERVAL_S = 2.0
# SIGTERM lets raylet and workers end their children; what has not ended by then gets SIGKILL.
TERM_GRACE_S = 3.0
# How long a SIGKILLed process may take to disappear (a kernel that is slow to reap a large process).
KILL_WAIT_S = 5.0
# The promise: no process of the session is left this many seconds after the driver's exit.
REAP_BOUND_S = 10.0
_PROC = Path("/proc")


# Never stopped because their command line names the session folder: a user looking at a Ray log from a shell.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "fish", "tcsh", "csh", "busybox"})


@dataclass(frozen=True)
class Proc:
    """One process as ``/proc/<pid>/stat`` shows it."""

    pid: int
    ppid: int
    start: int  # clock ticks after boot: with the pid, identifies a process for its lifetime
    state: str  # "Z": a zombie, already ended
    uid: int = -1  # the owner of /proc/<pid>: the process's effective uid
    tty: int = 0  # its controlling terminal's device number, 0 for none
    comm: str = ""  # its command name (at most 15 characters)
    pgrp: int = 0
    session: int = 0
    tpgid: int = -1  # the terminal's foreground process group, -1 without a terminal


def _read_stat(pid: int) -> Proc | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
        uid = (_PROC / str(pid)).stat().st_uid
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces and parentheses: split after the last ")".
    head, _, tail = text.rpartition(")")
    rest = tail.split()
    comm = head.partition("(")[2]
    return Proc(
        pid=pid,
        ppid=int(rest[1]),
        start=int(rest[19]),
        state=rest[0],
        uid=uid,
        tty=int(rest[4]),
        comm=comm,
        pgrp=int(rest[2]),
        session=int(rest[3]),
        tpgid=int(rest[5]),
    )


def process_table() -> dict[int, Proc]:
    """Every process this user can see, by pid."""
    table = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (proc := _read_stat(int(entry.name))) is not None:
            table[proc.pid] = proc
    return table


def strange_by_folder(proc: Proc) -> bool:
    """Whether a process whose command line names the session folder is still not the cluster's: a shell, or one
    that holds a terminal (the leader of a terminal's session, or a process in its foreground, what a user looks
    at). Ray's processes of a driver started at a terminal share that terminal, but not its foreground once the
    driver has ended."""
    holds_terminal = proc.tty != 0 and (proc.session == proc.pid or proc.tpgid == proc.pgrp)
    return holds_terminal or proc.comm in SHELLS


def descendants(roots: set[int], table: dict[int, Proc]) -> set[int]:
    """The pids below ``roots`` in ``table`` (the roots not included)."""
    children: dict[int, list[int]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found, stack = set(), list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found and child not in roots:
                found.add(child)
                stack.append(child)
    return found


def names_folder(pid: int, folder: str) -> bool:
    """Whether an argument of ``pid``'s command line is ``folder``, ends in ``=folder`` or lies inside it."""
    try:
        args = (_PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    name = os.fsencode(folder.rstrip("/"))
    return any(arg == name or arg.endswith(b"=" + name) or name + b"/" in arg for arg in args)


def alive(pid: int, start: int) -> bool:
    """Whether the process recorded as (pid, start) still runs (not ended, not a zombie, pid not reused)."""
    proc = _read_stat(pid)
    return proc is not None and proc.start == start and proc.state != "Z"


def reap(recorded: dict[int, int], session_dir: str | None) -> tuple[int, int]:
    """Stop the recorded processes still alive, those naming ``session_dir`` and all their descendants: SIGTERM,
    then SIGKILL for whatever is left after :data:`TERM_GRACE_S` or started meanwhile, all within
    :data:`TERM_GRACE_S` + :data:`KILL_WAIT_S`.

    Returns (processes stopped, of which by SIGKILL).
    """
    me, uid = os.getpid(), os.geteuid()
    stopped: dict[int, int] = {}  # pid -> start time of every process signalled
    killed: set[int] = set()

    def targets() -> dict[int, int]:
        table = {pid: proc for pid, proc in process_table().items() if proc.uid == uid}  # never another user's
        roots = {pid for pid, start in {**recorded, **stopped}.items() if pid in table and table[pid].start == start}
        if session_dir:
            roots |= {pid for pid in table if not strange_by_folder(table[pid]) and names_folder(pid, session_dir)}
        found = roots | descendants(roots, table)
        return {pid: table[pid].start for pid in found - {me, 1} if table[pid].state != "Z"}

    def wait(pids: set[int], until: float) -> None:
        while time.monotonic() < until and any(alive(pid, stopped[pid]) for pid in pids):
            time.sleep(0.05)

    began = time.monotonic()
    first = targets()
    stopped.update(first)
    for pid, start in first.items():
        _signal(pid, start, signal.SIGTERM)
    wait(set(first), began + TERM_GRACE_S)
    for _ in range(3):  # a process may start another while it is stopped: look again, a bounded number of times
        left = {pid: start for pid, start in targets().items() if stopped.get(pid, start) == start}
        if not left or time.monotonic() >= began + TERM_GRACE_S + KILL_WAIT_S:
            break
        stopped.update(left)
        for pid, start in left.items():
            _signal(pid, start, signal.SIGKILL)
        killed |= set(left)
        wait(set(left), began + TERM_GRACE_S + KILL_WAIT_S)
    return len(stopped), len(killed)


def _signal(pid: int, start: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to the process recorded as (pid, start), never to another that has its pid now; whether sent.

    Through a pidfd where the kernel has them: opened first, then the process is checked to be the recorded one,
    and the signal goes to the process the pidfd holds (a pid reused after the check is not it)."""
    pidfd_open = getattr(os, "pidfd_open", None)
    fd = None
    if pidfd_open is not None:
        try:
            fd = pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError:
            fd = None  # ENOSYS: a kernel before 5.3; signal by pid below
    try:
        proc = _read_stat(pid)
        if proc is None or proc.start != start or proc.uid != os.geteuid():
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def watch(driver_pid: int, driver_start: int, session_dir: str | None) -> tuple[int, int]:
    """Record the driver's process tree until the driver has ended, then :func:`reap` (the reaper's body)."""
    recorded: dict[int, int] = {}
    next_scan = 0.0
    while alive(driver_pid, driver_start):
        if time.monotonic() >= next_scan:
            table = process_table()
            recorded.update({pid: table[pid].start for pid in descendants({driver_pid}, table) if pid in table})
            next_scan = time.monotonic() + SCAN_INTERVAL_S
        time.sleep(DEATH_POLL_S)
    return reap(recorded, session_dir)


def watch_driver(session_dir: str | None, driver_pid: int | None = None) -> subprocess.Popen:
    """Start the reaper for ``driver_pid`` (default: this process) and the Ray session folder ``session_dir``.

    The reaper runs in a session of its own, with no stdin or stdout; its stderr is the caller's, where it says
    what it stopped.
    """
    pid = os.getpid() if driver_pid is None else int(driver_pid)
    proc = _read_stat(pid)
    if proc is None:
        raise ValueError(f"no process {pid} to watch")
    command = [sys.executable, "-m", "respo_verl.run.reaper", str(pid), str(proc.start)]
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

    try:
        if stat.S_ISREG(os.fstat(2).st_mode):
            fcntl.fcntl(2, fcntl.F_SETFL, fcntl.fcntl(2, fcntl.F_GETFL) | os.O_APPEND)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m respo_verl.run.reaper", description=__doc__.split("\n")[0])
    parser.add_argument("driver_pid", type=int)
    parser.add_argument("driver_start", type=int, help="the driver's start time, field 22 of /proc/<pid>/stat")
    parser.add_argument("--session-dir", default=None, help="the Ray session folder the driver started")
    args = parser.parse_args(argv)
    # A Ctrl-C at the terminal, or SIGTERM (a save-and-stop request) sent to every process of a job, is for the
    # driver: the reaper ends by itself once the driver has ended and its cluster is stopped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stopped, killed = watch(args.driver_pid, args.driver_start, args.session_dir)
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
