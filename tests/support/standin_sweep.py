"""``respo-verl sweep`` whose runs are the stand-in program (tests/support/standin/standin_run.py) instead of verl's
trainer.

``python tests/support/standin_sweep.py <sweep options> -- <overrides>`` is ``respo-verl sweep`` itself (its grid,
manifest, folder lock, local and Ray executors, progress, reports), with one difference: a run's command is
``python -m standin_run <the run's overrides>`` where it would be ``python -m respo_verl.main_ppo ...``
(:data:`respo_verl.tools.sweep.grid.ENTRY_MODULES`). Its folder, :data:`STANDIN_PATH` (nothing else is in it), is put
on ``PYTHONPATH`` for the runs started here; a Ray head that runs them as jobs must have it on its own
``PYTHONPATH`` (tests/tools/sweep/test_sweep_ray.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STANDIN_SWEEP = str(HERE / "standin_sweep.py")
STANDIN_PATH = str(HERE / "standin")
MODULE = "standin_run"


def main(argv: list[str]) -> int:
    from respo_verl.cli import main as cli_main
    from respo_verl.tools.sweep import grid

    grid.ENTRY_MODULES["respo"] = MODULE
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (STANDIN_PATH, os.environ.get("PYTHONPATH")) if p)
    return cli_main(["sweep", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
