"""The Slurm template's pre-emption path: scripts/launch/slurm/respo_verl.sbatch under real Slurm, two nodes on this
host (scripts/dev/local_slurm.py).

What is real: Slurm (``sbatch``, the batch shell's signal, ``srun`` steps, ``scontrol requeue`` and the requeued job
running again), the template, the planner it calls (``python3 -m respo_verl.cli plan``), and
``scripts/launch/ray_cluster.sh``: in its dry-run mode (``DRY_RUN=1``: each node's step prints the ``ray start`` it
would run) where Ray is not what is tested, and starting Ray for real where the signal comes while Ray starts. The
run itself is a stand-in (``SCRIPT``) that the test controls: it records its arguments, the job's restart count and
the signals it gets; on SIGTERM it "saves" for a second and exits 0, as ``respo_verl.main_ppo`` does; run again after
a save it resumes and ends.

The pre-emption's SIGTERM is ``scancel --signal=TERM --batch``: the batch shell alone gets it, as from the template's
``--signal=B:TERM@900`` before the time limit (whose timing Slurm keeps only to the minute). Slurm holds a requeued
job for two minutes before it may start again; the test moves that begin time to two seconds after the requeue
(``scontrol update StartTime=now``) to stay within the suite's time.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.local_slurm import LocalSlurm, free_port_block, start_or_skip, time_limit_past_notice
from support.procs import naming, wait_gone

# Slurm jobs of the template (5-20 s each)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts/launch/slurm/respo_verl.sbatch"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
# The stand-in run: "started" once running; on SIGTERM it saves for a second and exits 0; run again after a save it
# resumes and ends with status 0; else it ends as told.
STAND_IN = """#!/usr/bin/env bash
echo "args $* restart=${SLURM_RESTART_COUNT:-0}" >> "$RUN_LOG"
trap 'echo TERM >> "$RUN_LOG"; sleep 1; echo saved >> "$RUN_LOG"; exit 0' TERM
if grep -qx saved "$RUN_LOG"; then echo resumed >> "$RUN_LOG"; exit 0; fi
echo started >> "$RUN_LOG"
if [[ "$RUN_ENDS" == never ]]; then
  while true; do sleep 0.1; done
fi
exit "$RUN_ENDS"
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = start_or_skip(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def _submit(slurm: LocalSlurm, case: Path, run_ends: str, **env: str) -> tuple[str, Path, Path]:
    case.mkdir(parents=True, exist_ok=True)
    script = case / "run.sh"
    script.write_text(STAND_IN)
    out, run_log = case / "job.out", case / "run.log"
    full = {
        **{k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"},
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "SCRIPT": str(script),
        "RUN_LOG": str(run_log),
        "RUN_ENDS": run_ends,
        "RAY_AUTH_TOKEN_PATH": str(case / "token"),
        "RAY_START_ARGS": "--disable-usage-stats --labels=x",
        "DRY_RUN": "1",  # ray_cluster.sh prints each node's ray start instead of running it
        **env,
    }
    # the template's own resources but for the GPUs: a node of the local Slurm has one (NUM_GPUS stays 8: Ray's); a
    # time limit past the template's notice, which is the test's to send
    limit = time_limit_past_notice(SBATCH)
    job = slurm.sbatch("--gpus-per-node=1", limit, f"--output={out}", str(SBATCH), env=full, cwd=ROOT)
    return job, out, run_log


def _wait_for(path: Path, text: str, slurm: LocalSlurm, job: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text():
            return
        state = slurm.job(job).get("JobState")
        assert state not in ENDED, f"job {job} {state} before {text!r} in {path.name}:\n{_text(path)[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s:\n{_text(path)[-3000:]}\n{slurm.logs()}")


def _text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def _lines(path: Path) -> list[str]:
    return _text(path).splitlines()


def _requeued(slurm: LocalSlurm, job: str, out: Path) -> dict[str, str]:
    """Wait until the job is pending again after its requeue; its fields."""
    fields = slurm.wait_job(job, ("PENDING",), timeout=60, what=_text(out)[-2000:])
    assert fields["Restarts"] == "1", fields
    return fields


def test_sigterm_reaches_the_run_which_saves_then_the_job_requeues_and_resumes(slurm, tmp_path):
    job, out, run_log = _submit(slurm, tmp_path, "never")
    _wait_for(run_log, "started", slurm, job)
    slurm.run(["scancel", "--signal=TERM", "--batch", job])
    _requeued(slurm, job, out)
    # the run got the signal, saved, and only then was the job requeued
    assert _lines(run_log) == ["args trainer.nnodes=2 restart=0", "started", "TERM", "saved"], _text(out)
    text = _text(out)
    assert f"stopped on SIGTERM (exit 0); requeueing job {job} to resume" in text
    # the planner ran for the allocation; each node's ray start, with its own address from Slurm and the knobs
    assert "OK: every rule holds" in text
    assert " ray start --head --port=6379 --num-gpus=8 --num-cpus=64 --node-ip-address=127.0.0.1 " in text, text
    assert "--dashboard-port=8265 --temp-dir=/tmp/ray --block --disable-usage-stats --labels=x" in text, text
    worker = " ray start --address=127.0.0.1:6379 --num-gpus=8 --num-cpus=64 --node-ip-address=127.0.0.2 --block "
    assert worker + "--disable-usage-stats --labels=x" in text, text

    # Slurm's two minutes, cut short; not within the second of the requeue, whose revoked job credential slurmd
    # compares to the new one's to the second ("Job credential revoked")
    time.sleep(2)
    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    fields = slurm.wait_job(job, ENDED, timeout=120, what=_text(out)[-2000:])
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), _text(out)
    # the requeued job ran the run again, which saw the restart and resumed from its save; no second requeue
    assert _lines(run_log)[4:] == ["args trainer.nnodes=2 restart=1", "resumed"], _text(out)
    assert _text(out).count("requeueing") == 1


def test_a_run_that_ends_by_itself_is_not_requeued_and_its_status_is_the_jobs(slurm, tmp_path):
    jobs = {ends: _submit(slurm, tmp_path / f"ends-{ends}", ends) for ends in ("0", "3")}
    for ends, (job, out, run_log) in jobs.items():
        fields = slurm.wait_job(job, ENDED, timeout=120)
        expected = ("COMPLETED", "0:0") if ends == "0" else ("FAILED", f"{ends}:0")
        assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == (*expected, "0"), _text(out)
        assert _lines(run_log) == ["args trainer.nnodes=2 restart=0", "started"], _text(out)
        assert "requeue" not in _text(out)


def test_sigterm_before_the_run_starts_requeues_without_starting_it(slurm, tmp_path):
    """Here Ray starts for real, and the signal comes while the job waits for it: the job stops Ray, leaves none of
    its processes, and requeues."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    base = free_port_block(2 + 20)
    ports = {"RAY_PORT": str(base), "DASHBOARD_PORT": str(base + 1), "RAY_NODE_PORTS": str(base + 2)}
    try:
        job, out, run_log = _submit(
            slurm, tmp_path, "0", DRY_RUN="0", NUM_GPUS="1", NUM_CPUS="8", RAY_TMPDIR=str(ray_tmp), **ports
        )
        _wait_for(out, "ray start --head", slurm, job)  # the job is waiting for Ray's nodes
        slurm.run(["scancel", "--signal=TERM", "--batch", job])
        _requeued(slurm, job, out)
        assert f"SIGTERM before the run started; requeueing job {job}" in _text(out)
        assert not run_log.exists()
        left = wait_gone(naming(str(ray_tmp)), bound=15)
        assert not left, [proc.cmdline() for proc in left]
        slurm.run(["scancel", job])
    finally:
        for proc in naming(str(ray_tmp)):
            proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
