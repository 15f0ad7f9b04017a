"""Test support: the local Slurm of scripts/dev/local_slurm.py (scripts stand on the package, never on the tests, so
the tests load the script's module from its file), and the fixture's start that skips or fails."""

from __future__ import annotations

import importlib.util
import os
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
