"""``respo-verl sweep --slurm`` on a Slurm of two nodes on this host (scripts/dev/local_slurm.py): the grid as one
job array through the Slurm template.

Real: Slurm, sbatch's job array and its ``%K`` limit, the template (its Ray in dry-run mode, ``DRY_RUN=1``: Ray
under the template is tests/scripts/test_slurm_template.py), the sweep, its manifest and progress. The runs are the
stand-in program (tests/support/standin_sweep.py), not verl's trainer, which would take minutes per run.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.local_slurm import start_or_skip, time_limit_past_notice
from support.standin_sweep import STANDIN_SWEEP

from respo_verl.tools.runs.logs import read_log

# a Slurm and a sweep of three runs through it (about 40 s)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
# the sweep submits the template, whose pre-emption notice comes a fixed lead before the time limit
TIME_LIMIT = time_limit_past_notice(ROOT / "scripts/launch/slurm/respo_verl.sbatch")
RUNS = ("cpu-respo-n2-s0", "cpu-respo-n2-s1", "cpu-respo-n2-s2")
STEPS = 2


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = start_or_skip(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def _sweep(slurm, out: Path, seeds: str = "0,1,2", *overrides: str, **popen) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, STANDIN_SWEEP, "--out", str(out), "--model", "cpu", "--algos", "respo", "--reuse", "2",
        "--seeds", seeds, "--mini-batch", "2", "--optimizer-steps", str(2 * STEPS), "--no-compose",
        "--slurm", "--max-running", "1", "--sbatch", f"--nodes=1 --gpus-per-node=1 {TIME_LIMIT}",
        "--", "+standin.step_s=0.2", *overrides,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT")}
    env.update(
        SLURM_CONF=str(slurm.conf),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        PRESET="qwen3_1p7b_h100_1x8",  # the template's plan: a one-node preset for one-node tasks
        DRY_RUN="1",
    )
    if popen:
        # as from a terminal, where Ctrl-C interrupts: a process started in the background (CI's runner, nohup)
        # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it
        return subprocess.Popen(
            cmd, text=True, env=env, cwd=ROOT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen
        )
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_the_grid_runs_as_one_job_array_one_at_a_time_and_a_rerun_submits_nothing(slurm, tmp_path):
    out = tmp_path / "sweep"
    res = _sweep(slurm, out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + slurm.logs()
    lines = res.stdout.strip().splitlines()
    assert lines[-1] == "3 done", lines[-5:]
    (submitted,) = [line for line in lines if line.startswith("submitted ")]
    assert submitted.startswith("submitted 3 runs as Slurm job array "), submitted
    job_id = submitted.rsplit(" ", 1)[1]
    for i, name in enumerate(RUNS):
        assert f"{name}: Slurm job {job_id}_{i} completed" in res.stdout
        assert sorted(read_log(out / "logs" / f"{name}.jsonl").steps) == list(range(1, STEPS + 1))
        output = (out / "logs" / f"{name}.out").read_text()  # the run's output, after the task's own line
        assert output.startswith(f"=== respo-verl sweep, Slurm job {job_id}_{i} on ") and f"ran {STEPS} steps" in output
    # never two at once (%1): each task started once the one before had ended (Slurm's times, to the second)
    tasks = [slurm.job(f"{job_id}_{i}") for i in range(len(RUNS))]
    assert [t["JobState"] for t in tasks] == ["COMPLETED"] * 3, tasks
    spans = sorted((t["StartTime"], t["EndTime"]) for t in tasks)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans)), spans

    again = _sweep(slurm, out)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1] == "3 done"
    assert "submitted" not in again.stdout
    assert slurm.run(["squeue", "-h"]).stdout.strip() == ""  # nothing was submitted


def test_a_failed_run_is_reported_with_its_last_lines_and_exit_status(slurm, tmp_path):
    out = tmp_path / "sweep"
    name = RUNS[0]
    res = _sweep(slurm, out, "0", f"+standin.fail={name}@1")  # the run exits with status 3 in its first step
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == f"0 done, 1 failed: {name}"
    report = res.stdout[res.stdout.index(f"run {name} failed: Slurm job ") :]
    assert report.splitlines()[0].endswith(f"FAILED, exit status 3, 0 of {STEPS} steps logged"), report
    assert f"  | standin: {name} fails in step 1 (+standin.fail)" in report, report
    assert f"  full output: {out / 'logs' / f'{name}.out'}" in report, report


def test_ctrl_c_leaves_the_array_running_and_the_same_command_waits_for_it_again(slurm, tmp_path):
    out, log = tmp_path / "sweep", tmp_path / "sweep.log"
    with log.open("w") as fh:
        sweep = _sweep(slurm, out, "0,1", "+standin.step_s=1", stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while "submitted 2 runs as Slurm job array" not in log.read_text():
            assert sweep.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        sweep.send_signal(signal.SIGINT)
        assert sweep.wait(timeout=60) == 130, log.read_text()
    text = log.read_text()
    job_id = text.split("submitted 2 runs as Slurm job array ", 1)[1].split()[0]
    assert f"stopped waiting; Slurm job array {job_id} goes on" in text and f"scancel {job_id}" in text, text
    assert slurm.run(["squeue", "-h", "-j", job_id]).stdout.strip(), "the array was cancelled"

    again = _sweep(slurm, out, "0,1", "+standin.step_s=1")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"Slurm job array {job_id} of this folder still runs: waiting for it" in again.stdout
    assert "submitted" not in again.stdout and again.stdout.strip().splitlines()[-1] == "2 done"
