"""A stand-in for a verl run in the sweep's tests: ``python -m standin_run <overrides>`` (this folder on PYTHONPATH,
tests/support/standin_sweep.py).

It does, in a second, what the sweep's mechanics need from a run of ``respo_verl.main_ppo`` and nothing else: it
reads the overrides the sweep gives every run, writes one verl file-logger line per step to
``$VERL_FILE_LOGGER_PATH``, saves a checkpoint folder at ``trainer.save_freq`` (``global_step_<k>/`` with the
respo-verl marker, then verl's tracker file), resumes from the tracker on a relaunch (a ``resume`` line in the log, as
the respo-verl trainer's logger writes), and on SIGTERM saves at the end of its step and ends with exit status 0, as
the respo-verl trainer does. It imports nothing but the standard library, so that it starts at once on any node.

Its own knobs, each an override shared by every run of a sweep (``respo-verl sweep ... -- +standin.step_s=0.5``) or
the environment variable ``STANDIN_<KNOB>`` (the override wins): ``step_s``, seconds per step (default 0.5);
``slow=<experiment>@<seconds>``, that run's seconds per step; ``fail=<experiment>@<step>``, that run exits with status
3 in that step, before logging it (``/`` between the items of several runs); ``save_s``, seconds the save after
SIGTERM takes (default 0), as a real checkpoint does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

MARKER = "respo_verl_run.json"  # respo_verl.checkpoint.MARKER
TRACKER = "latest_checkpointed_iteration.txt"  # respo_verl.checkpoint.TRACKER
FAILED_STATUS = 3
PREFIX = "standin:"


def _overrides(argv: list[str]) -> dict[str, str]:
    return dict(arg.lstrip("+").split("=", 1) for arg in argv if "=" in arg)


def _knob(options: dict[str, str], knob: str, default: str = "") -> str:
    return options.get(f"standin.{knob}", os.environ.get(f"STANDIN_{knob.upper()}", default))


def _for_run(value: str, name: str) -> str | None:
    """The part after ``@`` of the ``<experiment>@<value>`` item of a knob (items separated by ``/``) that names this
    run, or None."""
    for item in value.split("/"):
        run, _, what = item.partition("@")
        if run == name and what:
            return what
    return None


def main(argv: list[str]) -> int:
    options = _overrides(argv)
    name = options.get("trainer.experiment_name", "run")
    steps = int(options["trainer.total_training_steps"])
    save_freq = int(options.get("trainer.save_freq", "-1"))
    folder = Path(options["trainer.default_local_dir"])
    step_s = float(_for_run(_knob(options, "slow"), name) or _knob(options, "step_s", "0.5"))
    fail_at = _for_run(_knob(options, "fail"), name)
    fail_at = int(fail_at) if fail_at else None
    log = Path(os.environ["VERL_FILE_LOGGER_PATH"])

    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))

    tracker = folder / TRACKER
    done = int(tracker.read_text()) if tracker.is_file() else 0
    print(f"{PREFIX} {name} starts, pid {os.getpid()}, {steps} steps", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    if done:
        print(f"{PREFIX} Resuming from {folder / f'global_step_{done}'}", flush=True)
        earlier = log.read_text().splitlines() if log.is_file() else []
        attempt = 2 + sum('"event": "resume"' in line for line in earlier)
        with log.open("a") as fh:
            fh.write(json.dumps({"event": "resume", "attempt": attempt}) + "\n")

    for step in range(done + 1, steps + 1):
        step_ends = time.monotonic() + step_s
        while time.monotonic() < step_ends:
            time.sleep(0.05)
        if step == fail_at:
            print(f"{PREFIX} {name} fails in step {step} (+standin.fail)", flush=True)
            return FAILED_STATUS
        with log.open("a") as fh:
            fh.write(json.dumps({"step": step, "data": {"critic/score/mean": -1.0 + step / steps}}) + "\n")
        print(f"{PREFIX} step {step} of {steps} logged", flush=True)
        if stop or (save_freq > 0 and step % save_freq == 0) or step == steps:
            if stop:
                time.sleep(float(_knob(options, "save_s", "0")))
            saved = folder / f"global_step_{step}"
            saved.mkdir(parents=True, exist_ok=True)
            (saved / MARKER).write_text(json.dumps({"step": step, "run": name}) + "\n")
            tracker.write_text(str(step))
        if stop:
            print(f"{PREFIX} SIGTERM: saved global_step_{step}, ending the run", flush=True)
            return 0
    print(f"{PREFIX} {name} ran {steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
