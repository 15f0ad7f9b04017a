"""Test support: the local Slurm of scripts/dev/local_slurm.py (scripts stand on the package, never on the tests, so
the tests load the script's module from its file), the fixture's start that skips or fails, and the time limit of a
test's job."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "local_slurm.py"
_SPEC = importlib.util.spec_from_file_location("local_slurm", _PATH)
local_slurm = sys.modules.get("local_slurm") or importlib.util.module_from_spec(_SPEC)
if "local_slurm" not in sys.modules:
    sys.modules["local_slurm"] = local_slurm
    _SPEC.loader.exec_module(local_slurm)

NODES, LocalSlurm, free_port_block, missing = (
    local_slurm.NODES,
    local_slurm.LocalSlurm,
    local_slurm.free_port_block,
    local_slurm.missing,
)


# slurmctld may send a --signal notice up to this long before it is due (sbatch(1), --signal)
NOTICE_EARLY_S = 60
# The tests' jobs end well within this (their own bounds are a few minutes).
JOB_S = 600


def time_limit_past_notice(script: Path) -> str:
    """The ``--time`` option for a test's job of the batch script ``script`` whose ``#SBATCH --signal=...@LEAD``
    directive asks a notice LEAD seconds before the time limit: a limit that leaves the notice due only after the job
    has ended. With a limit not longer than LEAD the notice is due at once, and slurmctld sends it at its first
    periodic check of the time limits, within half a minute of the job's start (docs/cluster.md, "Slurm on one
    host")."""
    found = re.findall(r"^#SBATCH --signal=\S*@(\d+)\s*$", Path(script).read_text(), flags=re.MULTILINE)
    if len(found) != 1:
        raise ValueError(f"{script}: expected one '#SBATCH --signal=...@SECONDS' directive, found {len(found)}")
    return f"--time={math.ceil((int(found[0]) + NOTICE_EARLY_S + JOB_S) / 60)}"


def start_or_skip(folder: Path) -> LocalSlurm:
    """A started local Slurm in ``folder``; the test skips, in one line that says why, where none can start here,
    and fails instead under CI (``CI=true``), where the Slurm tests must run."""
    import pytest

    why = missing()
    if why and os.environ.get("CI") == "true":
        pytest.fail(f"CI=true, and the Slurm tests cannot run: {why}")
    if why:
        pytest.skip(why)
    return LocalSlurm(folder).start()
