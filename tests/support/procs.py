"""Test support: the processes a test started or looks for, through psutil, with the reaper's own notion of a
process that still runs (:func:`respo_verl.run.reaper.running`: not ended, not a zombie, its pid not reused)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil

from respo_verl.run.reaper import running


def wait_gone(procs: Iterable[psutil.Process], bound: float) -> list[psutil.Process]:
    """Wait up to ``bound`` seconds for every process of ``procs`` to end; those still running then."""
    procs = list(procs)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and any(map(running, procs)):
        time.sleep(0.05)
    return [proc for proc in procs if running(proc)]


def gone_within(pid: int, bound: float) -> bool:
    """Whether process ``pid`` (as it is now) has ended within ``bound`` seconds."""
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return True
    return not wait_gone([proc], bound)


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants."""
    try:
        return pid == ancestor or any(parent.pid == ancestor for parent in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def titled(root: int, title: str) -> list[psutil.Process]:
    """The running descendants of ``root`` whose command line (a process title, for Ray's and vLLM's) starts with
    ``title``."""
    found = []
    for proc in psutil.Process(root).children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith(title):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def naming(text: str) -> list[psutil.Process]:
    """Every process with ``text`` in an argument of its command line (a Ray temp dir: every process of that Ray)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if any(text in arg for arg in proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


__all__ = ["descends_from", "gone_within", "naming", "running", "titled", "wait_gone"]
