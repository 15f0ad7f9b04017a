"""The Slurm template's pre-emption path: scripts/launch/slurm/respo_verl.sbatch run under bash.

What is real: bash running the script as Slurm would (its trap, wait and exit status), the planner it calls
(``python3 -m respo_verl.cli plan``), ``scripts/launch/ray_cluster.sh`` in its own dry-run mode (``DRY_RUN=1``: it
prints the ``ray start`` it would run; a Ray cluster is not what is tested here) and ``hostname``. What is faked,
because Slurm cannot run here: ``scontrol`` (``show hostnames`` splits the node list on commas; ``requeue`` is
recorded) and ``srun`` (records its arguments and execs the command on this machine, so that a signal sent to the
srun process reaches the command, as srun forwards it). The run itself is a stand-in (``SCRIPT``) that the test
controls: it records its arguments and the signals it gets, and on SIGTERM "saves" for a second and exits 0, as
``respo_verl.main_ppo`` does.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

# bash scripts with signals, sleeps and waits (2-7 s each)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts/launch/slurm/respo_verl.sbatch"
JOB_ID = "4242"

FAKE_SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_SLURM_LOG"
case "$1 $2" in
  "show hostnames") tr ',' '\\n' <<< "$3" ;;
  requeue*) ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""
FAKE_SRUN = """#!/usr/bin/env bash
echo "srun $*" >> "$FAKE_SLURM_LOG"
while [[ "${1:-}" == -* ]]; do
  if [[ "$1" == -w ]]; then shift 2; else shift; fi
done
exec "$@"
"""
# The stand-in run: "started" once running; on SIGTERM it saves for a second and exits 0; else it ends as told.
STAND_IN = """#!/usr/bin/env bash
echo "args $*" >> "$RUN_LOG"
trap 'echo TERM >> "$RUN_LOG"; sleep 1; echo saved >> "$RUN_LOG"; exit 0' TERM
echo started >> "$RUN_LOG"
if [[ "$RUN_ENDS" == never ]]; then
  while true; do sleep 0.1; done
fi
exit "$RUN_ENDS"
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _start(tmp_path: Path, run_ends: str, ray_wait: int = 0) -> tuple[subprocess.Popen, Path, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "scontrol", FAKE_SCONTROL)
    _executable(bin_dir / "srun", FAKE_SRUN)
    script = _executable(tmp_path / "run.sh", STAND_IN)
    slurm_log, run_log = tmp_path / "slurm.log", tmp_path / "run.log"
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]),
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NODELIST": "node1,node2",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SCRIPT": str(script),
        "DRY_RUN": "1",  # ray_cluster.sh prints its ray start instead of running it
        "RAY_WAIT": str(ray_wait),
        "FAKE_SLURM_LOG": str(slurm_log),
        "RUN_LOG": str(run_log),
        "RUN_ENDS": run_ends,
        "SLURM_CPUS_PER_TASK": "64",  # Slurm's --cpus-per-task: NUM_CPUS of every node
        "RAY_START_ARGS": "--disable-usage-stats --labels=x",
    }
    proc = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, slurm_log, run_log


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text():
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s")


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def test_sigterm_is_forwarded_the_script_waits_for_the_run_and_requeues(tmp_path):
    proc, slurm_log, run_log = _start(tmp_path, "never")
    _wait_for(run_log, "started", proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    # the run got the signal, saved, and only then was the job requeued
    assert _lines(run_log) == ["args trainer.nnodes=2", "started", "TERM", "saved"], out
    assert f"stopped on SIGTERM (exit 0); requeueing job {JOB_ID} to resume" in out
    calls = _lines(slurm_log)
    assert calls[-1] == f"scontrol requeue {JOB_ID}" and sum("requeue" in c for c in calls) == 1, calls
    # the planner ran for the allocation, Ray's head and worker were started on their nodes, the run on the head
    assert "OK: every rule holds" in out
    assert (
        "srun --nodes=1 --ntasks=1 -w node1 env RAY_PORT=6379 NUM_GPUS=8 NUM_CPUS=64 NODE_IP=127.0.0.1 "
        "bash scripts/launch/ray_cluster.sh head --disable-usage-stats --labels=x" in calls
    )
    assert (
        "srun --nodes=1 --ntasks=1 -w node2 env RAY_PORT=6379 NUM_GPUS=8 NUM_CPUS=64 "
        "bash scripts/launch/ray_cluster.sh worker 127.0.0.1 --disable-usage-stats --labels=x" in calls
    )
    # ray_cluster.sh's dry run: the ray start each node would run, with the knobs
    assert "ray start --head --port=6379 --num-gpus=8 --num-cpus=64 --node-ip-address=127.0.0.1 " in out, out
    assert "--num-cpus=64 --block --disable-usage-stats --labels=x" in out, out
    assert f"srun --overlap --nodes=1 --ntasks=1 -w node1 bash {tmp_path / 'run.sh'} trainer.nnodes=2" in calls


def test_a_run_that_ends_by_itself_is_not_requeued_and_its_status_is_the_jobs(tmp_path):
    for ends in ("0", "3"):
        case = tmp_path / f"ends-{ends}"
        case.mkdir()
        proc, slurm_log, run_log = _start(case, ends)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == int(ends), out
        assert _lines(run_log) == ["args trainer.nnodes=2", "started"], out
        assert not any("requeue" in c for c in _lines(slurm_log)) and "requeue" not in out, out


def test_sigterm_before_the_run_starts_requeues_without_starting_it(tmp_path):
    proc, slurm_log, run_log = _start(tmp_path, "0", ray_wait=3)
    _wait_for(slurm_log, "ray_cluster.sh head", proc)  # the script is waiting for Ray's head to come up
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert f"SIGTERM before the run started; requeueing job {JOB_ID}" in out
    assert not run_log.exists()
    assert _lines(slurm_log)[-1] == f"scontrol requeue {JOB_ID}"
