"""The reaper that stops a driver's local Ray cluster once the driver has ended (respo_verl/run/reaper.py).

Real processes, no Ray: a stand-in driver starts a tree of children (one that ignores SIGTERM, one orphaned before
the driver dies, one that names the session folder but is not in the driver's tree), starts the reaper as our
entry point does (:func:`watch_driver`) and is then killed with SIGKILL, or ends normally. Processes outside the tree
and naming another session folder must survive. The Ray run itself is covered by tests/cpu/test_cpu_resume.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.procs import running, wait_gone

from respo_verl.run.reaper import REAP_BOUND_S, SCAN_INTERVAL_S, names_folder

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")

MIDDLE = (
    "import subprocess as s, sys, time\n"
    "print(s.Popen(sys.argv[2:], stdout=s.DEVNULL, stderr=s.DEVNULL).pid, flush=True)\n"
    "time.sleep(float(sys.argv[1]))"
)
SLEEPER = (
    "import signal, sys, time\n"
    "if 'ignore-term' in sys.argv: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "time.sleep(300)"
)

# The stand-in driver: children, the reaper, an orphan, then the pids on stdout; it ends as told.
DRIVER = """
import json, os, subprocess, sys, time
from respo_verl.run.reaper import watch_driver
session, how = sys.argv[1], sys.argv[2]
sleeper = [sys.executable, "-c", {sleeper!r}]
child = subprocess.Popen(sleeper)
stubborn = subprocess.Popen([*sleeper, "ignore-term"])
reaper = watch_driver(session)
# a process that starts a grandchild, lives through a scan of the reaper and exits: the grandchild is orphaned
# while the driver lives, and is found only because the reaper recorded it
middle = subprocess.Popen(
    [sys.executable, "-c", {middle!r}, str({settle}), *sleeper], stdout=subprocess.PIPE, text=True
)
orphan = int(middle.stdout.readline())
middle.wait()
pids = {{"child": child.pid, "stubborn": stubborn.pid, "orphan": orphan, "reaper": reaper.pid}}
print(json.dumps(pids), flush=True)
if how == "exit":
    sys.exit(0)
time.sleep(300)
"""


def _start_driver(session: Path, how: str) -> tuple[subprocess.Popen, dict]:
    code = DRIVER.format(sleeper=SLEEPER, middle=MIDDLE, settle=SCAN_INTERVAL_S + 1)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(session), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pids = json.loads(proc.stdout.readline())
    return proc, pids


@pytest.mark.parametrize("how", ["sigkill", "exit"])
@pytest.mark.slow  # a process tree killed and waited for (7 s each)
def test_the_drivers_tree_and_its_session_are_gone_within_the_bound_others_stay(tmp_path, how):
    session = tmp_path / "session_2026-01-01_00-00-00_000001_42"
    bystander = _sleeper(str(session) + "2/logs")  # another session whose name starts like ours: not ours
    outsider = _sleeper()
    in_session = _sleeper(f"--session-dir={session}")  # not in the driver's tree, names our session folder
    driver, pids = _start_driver(session, how)
    names = {pids["child"]: "child", pids["stubborn"]: "stubborn", pids["orphan"]: "orphan", in_session.pid: "named"}
    victims = [psutil.Process(pid) for pid in names]
    reaper = psutil.Process(pids["reaper"])
    try:
        assert psutil.Process(pids["orphan"]).ppid() != driver.pid  # orphaned: found only because it was recorded
        if how == "sigkill":
            driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        ended = time.monotonic()
        left = [proc.pid for proc in wait_gone(victims, REAP_BOUND_S)]
        late = time.monotonic() - ended
        assert not left, f"still running {late:.1f} s after the driver ended: {[names[p] for p in left]}"
        assert wait_gone([reaper], 5) == []  # the reaper ends once it is done
        assert bystander.poll() is None and outsider.poll() is None
        report = driver.stderr.read()
        assert "respo-verl reaper: driver" in report and "stopped 4 process(es)" in report, report
        assert "(1 by SIGKILL)" in report, report  # the one that ignores SIGTERM
    finally:
        for proc in (bystander, outsider, in_session):
            proc.kill()
            proc.wait()
        for proc in [*victims, reaper]:
            if running(proc):
                proc.kill()
        driver.kill()
        driver.wait()


def test_folder_names(tmp_path):
    session = str(tmp_path / "session_x")
    inside, named, prefix = _sleeper(session + "/logs"), _sleeper(f"--temp={session}"), _sleeper(session + "2")
    try:
        assert names_folder(psutil.Process(inside.pid), session) and names_folder(psutil.Process(named.pid), session)
        assert not names_folder(psutil.Process(prefix.pid), session)
        assert not names_folder(psutil.Process(), "/nonexistent/session_x")
    finally:
        _stop(inside, named, prefix)


def test_watch_driver_refuses_a_pid_that_is_not_there():
    from respo_verl.run.reaper import watch_driver

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(ValueError, match=f"no process {dead.pid} to watch"):
        watch_driver(None, driver_pid=dead.pid)


# --- process control that cannot hit a stranger (issue 55) ---------------------------------------------------------


def _sleeper(*args: str, **popen) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, *args], **popen)
    deadline = time.monotonic() + 10
    while not _execd(proc.pid, args) and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc


def _execd(pid: int, args) -> bool:
    """Whether ``pid`` has exec'd the sleeper (its command line holds ``args``), so that it is what it stands for."""
    try:
        cmdline = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    return all(a in cmdline for a in args)


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process of another user needs root")
def test_a_process_of_another_user_is_never_stopped_even_when_recorded(tmp_path):
    from respo_verl.run.reaper import reap

    session = str(tmp_path / "session_x")
    stranger = subprocess.Popen(["sleep", "300"], user=65534)  # nobody's: "recorded", as a reused pid could be
    ours = _sleeper(session)
    while psutil.Process(stranger.pid).uids().effective != 65534:
        time.sleep(0.02)
    try:
        recorded = [psutil.Process(p.pid) for p in (stranger, ours)]
        reap(recorded, session)
        assert ours.wait(timeout=20) == -signal.SIGTERM
        assert stranger.poll() is None and running(recorded[0])
    finally:
        _stop(stranger, ours)


def test_a_shell_or_a_terminal_holder_naming_the_folder_is_left_alone(tmp_path):
    import fcntl
    import pty
    import termios

    from respo_verl.run.reaper import _terminal, reap

    session = str(tmp_path / "session_x")
    shell = subprocess.Popen(["bash", "-c", "sleep 300; : " + session])  # a user's shell, e.g. `less` of a log
    primary, secondary = pty.openpty()

    def take_terminal():  # the test's stand-in for a user's terminal program: leads a session on a terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    on_terminal = _sleeper(session, "on-terminal", stdin=secondary, start_new_session=True, preexec_fn=take_terminal)
    stray = _sleeper(session)  # an orphan of the cluster: no terminal, not a shell
    try:
        time.sleep(0.3)  # bash has started its `sleep`
        assert _terminal(on_terminal.pid)[0] != 0  # it holds the terminal it took
        reap([], session)
        assert stray.wait(timeout=20) == -signal.SIGTERM
        assert shell.poll() is None and on_terminal.poll() is None
    finally:
        _stop(shell, on_terminal, stray)
        os.close(primary)
        os.close(secondary)


def test_a_signal_goes_only_to_the_process_recorded_by_pid_and_start():
    from respo_verl.run.reaper import _signal

    proc = _sleeper()
    try:
        recorded = psutil.Process(proc.pid)
        reused = psutil.Process(proc.pid)
        reused._ident = (proc.pid, reused._ident[1] + 1)  # psutil's identity, another creation time: a reused pid
        assert not _signal(reused, signal.SIGTERM)
        assert proc.poll() is None
        assert _signal(recorded, signal.SIGTERM)
        assert proc.wait(timeout=20) == -signal.SIGTERM
        assert not _signal(recorded, signal.SIGTERM)  # gone (reaped): nothing is sent
    finally:
        _stop(proc)
