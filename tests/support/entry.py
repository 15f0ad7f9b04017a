"""``python -m respo_verl.main_ppo ARGV...`` in the test's own process, for the refusals that come before Ray.

A refusal before Ray needs no process of its own: :func:`respo_verl.main_ppo.main` takes the command line, and this
helper gives it what a fresh process would have, then puts back what the run changed in this one (the working
directory, Hydra's global state and logging, the CPU runtime a ``+device=cpu`` job switches on, the environment).
A job that is not refused goes on to ``ray.init``, which the fast tier refuses (tests/conftest.py): a refusal that
stops working fails the test instead of starting a cluster.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EntryResult:
    """What the command left: its exit status (0 when it returned), its standard output and error."""

    returncode: int
    stdout: str
    stderr: str


def run_entry(argv: list[str], cwd: Path) -> EntryResult:
    """Run ``python -m respo_verl.main_ppo *argv`` in this process, in the folder ``cwd``."""
    from hydra.core.global_hydra import GlobalHydra

    from respo_verl import main_ppo
    from respo_verl.cpu.runtime import RUNTIME

    runtime_was_applied = RUNTIME.applied
    environ = dict(os.environ)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    here = Path.cwd()
    out, err = io.StringIO(), io.StringIO()
    returncode = 0
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main_ppo.main(list(argv))
            except SystemExit as exc:
                returncode = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=err)
    finally:
        os.chdir(here)
        GlobalHydra.instance().clear()
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:], root.level = handlers, level
        if RUNTIME.applied and not runtime_was_applied:
            RUNTIME.remove()
        os.environ.clear()
        os.environ.update(environ)
    return EntryResult(returncode, out.getvalue(), err.getvalue())
