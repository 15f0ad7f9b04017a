"""The phase deadline interrupts the driver's main thread with ``_thread.interrupt_main``, which does nothing where
SIGINT has no Python handler: a driver started in the background by a non-interactive shell inherits SIGINT ignored.
:func:`respo_verl.run.launch.interruptible_main` gives it Python's handler back. Each case runs in a fresh process
whose SIGINT is ignored from its start, as ``nohup python ... &`` leaves it."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

PROGRAM = """
import _thread, signal, threading, time
from respo_verl.run import launch
assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, signal.getsignal(signal.SIGINT)
if {fix}:
    launch.interruptible_main()
threading.Timer(0.2, _thread.interrupt_main).start()
try:
    time.sleep(3)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.parametrize("fix, expected", [(False, "not interrupted"), (True, "interrupted")])
def test_a_driver_started_with_sigint_ignored_can_be_interrupted_by_the_deadline(fix, expected):
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(fix=fix)],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == expected
