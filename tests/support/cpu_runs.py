"""Launching ``python -m respo_verl.main_ppo algorithm=respo +device=cpu`` from a test, as a user runs it: a run
folder, verl's file logger in it, a Ray temp dir of its own, the output in a file. Shared by the end-to-end tests of
tests/cpu/ that stop, kill or resume runs."""

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

# test-only modules loaded in every Ray process of a run
MODULES = Path(__file__).resolve().parents[1] / "cpu" / "modules"
FAULTS = Path(__file__).resolve().parent / "cpu_modules"  # fault injections selected by file path
STOP = "respo_verl.main_ppo: stopped "


def run_env(log: Path) -> dict[str, str]:
    return {
        **os.environ,
        "VERL_FILE_LOGGER_PATH": str(log),
        "RESPO_VERL_CPU_KIT": str(kit_root()),
        "HF_HUB_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
        "TORCH_COMPILE_DISABLE": "1",
    }


def command(folder: Path, reuse: int, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "respo_verl.main_ppo",
        "algorithm=respo",
        "+device=cpu",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"data.train_batch_size={2 * reuse}",
        f"trainer.total_training_steps={steps}",
        "trainer.experiment_name=resume",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={folder}",
        *extra,
    ]


def start(tmp_path: Path, argv: list[str], ray_tmp: str, log: Path, out) -> subprocess.Popen:
    """Start ``argv`` in ``tmp_path`` with its Ray temp dir, its file logger at ``log`` and its output to ``out``."""
    return subprocess.Popen(
        [*argv, f"+ray_kwargs.ray_init._temp_dir={ray_tmp}"],
        cwd=tmp_path,
        env=run_env(log),
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def launch(
    tmp_path: Path,
    argv: list[str],
    sigterm_after_step: int | None = None,
    timeout: float = 600,
    while_running: Callable[[subprocess.Popen, str], None] | None = None,
):
    """Run ``argv`` (a Ray temp dir of its own); with ``sigterm_after_step``, send the driver SIGTERM as soon as
    the log holds that step; ``while_running(proc, output so far)`` is called every half second while it runs.
    Returns (returncode, output)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "log.jsonl"
    ray_tmp = tempfile.mkdtemp(prefix="rv-ray-", dir="/tmp")  # Ray's socket paths must stay short
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


def logged_steps(log: Path) -> list[int]:
    if not log.is_file():
        return []
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip().endswith("}")]
    return [r["step"] for r in records if "step" in r]


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (Linux /proc)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
    return False


def stop_line(out: str, pattern: str) -> re.Match:
    """The driver's one stop line, matched by ``pattern`` (after ``respo_verl.main_ppo: stopped ``); nothing after it
    is a traceback, and it is the only such line."""
    lines = [line for line in out.splitlines() if line.startswith(STOP)]
    assert len(lines) == 1, (lines, out[-4000:])
    found = re.fullmatch(re.escape(STOP) + pattern, lines[0])
    assert found, (lines[0], pattern)
    assert "Traceback" not in out[out.index(lines[0]) :], out[-4000:]
    return found
