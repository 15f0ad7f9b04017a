"""The one launcher of the end-to-end tests: ``python -m respo_verl.main_ppo ...`` (or verl's own ``main_ppo``) from a
test, as a user runs it: a run folder, verl's file logger in it, a Ray temp dir of its own, the output in a file.

Every test that starts a verl driver starts it here (:func:`launch`, or :func:`start` for a test that signals the
driver itself), or, when a tool of ours starts the drivers (``respo-verl sweep``, ``respo-verl demo``), says how many
it started with :func:`record_drivers`. Each driver is one line in the file named by :data:`DRIVERS_ENV`, which
tests/conftest.py sets and counts at the end of the session (the suite's budget of verl drivers, README "Testing").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from respo_verl.cpu.kit.build import kit_root
from respo_verl.entry_points import CPU_MODULE, PLUGIN_MODULE

# Test-only modules that a run loads in every Ray process (extra_modules) or selects by file path (a reward function).
FAULTS = Path(__file__).resolve().parent / "cpu_modules"
MODULES = FAULTS
STOP = "respo_verl.main_ppo: stopped "
OURS, VERLS = "respo_verl.main_ppo", "verl.trainer.main_ppo"
# The file the suite's verl drivers are counted in (one line each: the test, the command's entry point).
DRIVERS_ENV = "RESPO_VERL_TEST_DRIVERS"


def run_env(log: Path | None, entry: str = OURS) -> dict[str, str]:
    """The environment of a run: verl's file logger at ``log``, the CPU kit, offline, no token auth, no compile."""
    env = {
        **os.environ,
        "RESPO_VERL_CPU_KIT": str(kit_root()),
        "HF_HUB_OFFLINE": "1",
        "TORCH_COMPILE_DISABLE": "1",
    }
    env.pop("VERL_FILE_LOGGER_ROOT", None)
    if log is None:
        env.pop("VERL_FILE_LOGGER_PATH", None)
    else:
        env["VERL_FILE_LOGGER_PATH"] = str(log)
    if entry == VERLS:
        # verl's own entry point: the driver switches to verl on CPU through verl's external-module seam.
        env["VERL_USE_EXTERNAL_MODULES"] = CPU_MODULE
    return env


def main_ppo(*overrides: str, entry: str = OURS) -> list[str]:
    """``python -m <entry> <overrides>`` with this interpreter."""
    return [sys.executable, "-m", entry, *overrides]


def command(folder: Path, reuse: int, steps: int, *extra: str) -> list[str]:
    """ReSPO on the dense kit through our entry point at rollout reuse N = ``reuse`` for ``steps`` steps, its
    checkpoints in ``folder``."""
    return main_ppo(
        "algorithm=respo",
        "+device=cpu",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"data.train_batch_size={2 * reuse}",
        f"trainer.total_training_steps={steps}",
        "trainer.experiment_name=resume",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={folder}",
        *extra,
    )


def extra_modules(*modules: str, preset: tuple[str, ...] = (PLUGIN_MODULE, CPU_MODULE)) -> list[str]:
    """Overrides that make every Ray process of the run import the test-only ``modules`` of :data:`FAULTS` too, after
    the ``preset``'s own (``+device=cpu``'s by default; ``+device=cpu_megatron`` names the CPU module first)."""
    loaded = ",".join((*preset, *modules))
    return [
        f"ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='{loaded}'",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH={FAULTS}",
    ]


def after_steps(variable: str, folder: Path, steps: int) -> str:
    """The override that arms a fault module's ``variable`` (e.g. ``RAISING_REWARD_AFTER``) once the log of a run
    launched in ``folder`` holds ``steps`` steps: the fault then strikes in step ``steps + 1``."""
    return f"+ray_kwargs.ray_init.runtime_env.env_vars.{variable}='{folder / 'log.jsonl'}@{steps}'"


def record_drivers(count: int, what: str) -> None:
    """Count ``count`` verl drivers started by the running test (see the module docstring)."""
    path = os.environ.get(DRIVERS_ENV)
    if not path or count <= 0:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].split("::")[0]
    with open(path, "a") as fh:
        fh.write("".join(f"{test}\t{what}\n" for _ in range(count)))


def _entry_of(argv: list[str]) -> str:
    return argv[argv.index("-m") + 1] if "-m" in argv[:3] else argv[0]


def start(tmp_path: Path, argv: list[str], ray_tmp: str, log: Path, out) -> subprocess.Popen:
    """Start ``argv`` in ``tmp_path`` with its Ray temp dir, its file logger at ``log`` and its output to ``out``."""
    entry = _entry_of(argv)
    record_drivers(1, entry)
    return subprocess.Popen(
        [*argv, f"+ray_kwargs.ray_init._temp_dir={ray_tmp}"],
        cwd=tmp_path,
        env=run_env(log, entry),
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def ray_temp_dir() -> str:
    """A private Ray temp dir: Ray's socket paths must stay under 107 bytes, so not pytest's deep tmp_path."""
    return tempfile.mkdtemp(prefix="rv-ray-", dir="/tmp")


def launch(
    tmp_path: Path,
    argv: list[str],
    sigterm_after_step: int | None = None,
    timeout: float = 600,
    while_running: Callable[[subprocess.Popen, str], None] | None = None,
):
    """Run ``argv`` in ``tmp_path`` (a Ray temp dir of its own, verl's file log at ``tmp_path/log.jsonl``); with
    ``sigterm_after_step``, send the driver SIGTERM as soon as the log holds that step; ``while_running(proc, output
    so far)`` is called every half second while it runs. Returns (returncode, output)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "log.jsonl"
    ray_tmp = ray_temp_dir()
    out_path = tmp_path / f"out-{time.monotonic_ns()}.txt"
    try:
        with out_path.open("w") as out:
            proc = start(tmp_path, argv, ray_tmp, log, out)
            try:
                deadline = time.monotonic() + timeout
                signalled = sigterm_after_step is None
                while proc.poll() is None and time.monotonic() < deadline:
                    if not signalled and logged_steps(log) and max(logged_steps(log)) >= sigterm_after_step:
                        proc.send_signal(signal.SIGTERM)
                        signalled = True
                    if while_running is not None:
                        while_running(proc, out_path.read_text(errors="replace"))
                    time.sleep(0.5)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                    if time.monotonic() >= deadline:
                        pytest.fail(f"{argv} did not end within {timeout} s")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return proc.returncode, out_path.read_text(errors="replace")


def log_lines(folder: Path) -> list[dict]:
    """The lines of verl's file log of a run launched in ``folder`` (none when it logged nothing)."""
    log = folder / "log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []


def logged_steps(log: Path) -> list[int]:
    if not log.is_file():
        return []
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip().endswith("}")]
    return [r["step"] for r in records if "step" in r]


def stop_line(out: str, pattern: str) -> re.Match:
    """The driver's one stop line, matched by ``pattern`` (after ``respo_verl.main_ppo: stopped ``); nothing after it
    is a traceback, and it is the only such line."""
    lines = [line for line in out.splitlines() if line.startswith(STOP)]
    assert len(lines) == 1, (lines, out[-4000:])
    found = re.fullmatch(re.escape(STOP) + pattern, lines[0])
    assert found, (lines[0], pattern)
    assert "Traceback" not in out[out.index(lines[0]) :], out[-4000:]
    return found
