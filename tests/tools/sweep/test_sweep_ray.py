"""``respo-verl sweep --ray ADDRESS`` against a real Ray cluster: a head started here with ``ray start --head`` and its
dashboard (the Job Submission API), real ``python -m respo_verl.main_ppo +device=cpu`` jobs on this CPU. Nothing is
mocked.

One grid of two runs, ReSPO and VESPO at N = 2 (2 training steps each), shared by the module's tests: submitted with
``--no-wait``, submitted again at once with ``--no-wait`` (nothing is duplicated), then a third sweep waits for the
jobs while the test stops VESPO's job through the SDK: ReSPO's job succeeds, VESPO's is reported with its job id and
the tail of its ``ray job logs``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from respo_verl.cpu.kit.build import KitSpec, build_kit, kit_root
from respo_verl.run.reaper import reap
from respo_verl.tools.runs.logs import read_log
from respo_verl.tools.sweep.rayjobs import OUT_KEY

pytestmark = pytest.mark.slow

RESPO, VESPO = "cpu-respo-n2-s0", "cpu-vespo-n2-s0"
STEPS = 2
TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT")}
    env.update(RESPO_VERL_CPU_KIT=str(kit_root()), HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    env["TORCH_COMPILE_DISABLE"] = "1"
    # a job's `python` is the one on the cluster's PATH: this environment's
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def head():
    """A Ray head with its dashboard, 16 CPU slots and two fake GPU slots (the CPU preset's resource); its address."""
    build_kit(KitSpec(), progress=False)
    temp = tempfile.mkdtemp(prefix="rvh-", dir="/tmp")  # Ray's socket paths must stay short
    dashboard = _free_port()
    command = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={_free_port()}",
        f"--dashboard-port={dashboard}", "--include-dashboard=true", "--num-cpus=16", "--num-gpus=2",
        f"--temp-dir={temp}", "--disable-usage-stats",
    ]  # fmt: skip
    try:
        started = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        reap({}, temp)  # every process of this head's session (its temp dir is in their command lines)
        shutil.rmtree(temp, ignore_errors=True)


def _argv(address: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "respo_verl.cli", "sweep", "--ray", address, *extra, "--out", str(out),
        "--model", "cpu", "--algos", "respo,vespo", "--reuse", "2", "--seeds", "0", "--mini-batch", "2",
        "--optimizer-steps", str(2 * STEPS), "--",
        # the jobs join the cluster: Ray refuses num_cpus/num_gpus from a driver that connects to one
        "+device=cpu", "~ray_kwargs.ray_init.num_cpus", "~ray_kwargs.ray_init.num_gpus",
    ]  # fmt: skip


def _jobs(client, out: Path) -> dict[str, object]:
    return {j.submission_id: j for j in client.list_jobs() if (j.metadata or {}).get(OUT_KEY) == str(out.resolve())}


@pytest.fixture(scope="module")
def sweep(head, tmp_path_factory):
    from ray.job_submission import JobSubmissionClient

    root = tmp_path_factory.mktemp("sweep_ray")
    out = root / "out"
    client = JobSubmissionClient(head)
    result: dict = {"out": out, "client": client}
    first = subprocess.run(_argv(head, out, "--no-wait"), cwd=root, env=_env(), capture_output=True, text=True)
    result["first"] = (first.returncode, first.stdout + first.stderr)
    result["jobs_after_first"] = dict(_jobs(client, out))
    again = subprocess.run(_argv(head, out, "--no-wait"), cwd=root, env=_env(), capture_output=True, text=True)
    result["again"] = (again.returncode, again.stdout + again.stderr)
    result["jobs_after_again"] = dict(_jobs(client, out))

    waiting = root / "wait.txt"
    with waiting.open("w") as fh:
        waiter = subprocess.Popen(_argv(head, out), cwd=root, env=_env(), stdout=fh, stderr=subprocess.STDOUT)
        try:
            vespo = [j for j in result["jobs_after_first"].values() if j.metadata["respo_verl_run"] == VESPO]
            assert len(vespo) == 1, result["first"][1]
            job_id = vespo[0].submission_id
            deadline = time.monotonic() + TIMEOUT_S

            def ready() -> bool:  # the waiting sweep has found the job, and its driver is up (output to report)
                return f"{VESPO}: already" in waiting.read_text() and "ray init kwargs" in client.get_job_logs(job_id)

            while not ready() and waiter.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
            result["stopped"] = (job_id, client.stop_job(job_id))
            result["wait_status"] = waiter.wait(timeout=TIMEOUT_S)
        finally:
            if waiter.poll() is None:
                waiter.kill()
    result["wait"] = waiting.read_text()
    result["jobs_at_end"] = dict(_jobs(client, out))
    return result


def test_each_run_is_submitted_once_as_a_job(sweep):
    status, text = sweep["first"]
    assert status == 0, text[-3000:]
    jobs = sweep["jobs_after_first"]
    assert sorted(j.metadata["respo_verl_run"] for j in jobs.values()) == [RESPO, VESPO]
    for job_id, job in jobs.items():
        assert f"{job.metadata['respo_verl_run']}: submitted as job {job_id}" in text
        assert job.entrypoint.startswith(f"VERL_FILE_LOGGER_PATH={sweep['out'].resolve()}/logs/")
        assert " python -m respo_verl.main_ppo algorithm=" in job.entrypoint


def test_a_resubmission_while_the_jobs_are_pending_or_running_duplicates_nothing(sweep):
    status, text = sweep["again"]
    assert status == 0, text[-3000:]
    assert sweep["jobs_after_again"].keys() == sweep["jobs_after_first"].keys()
    for job_id, job in sweep["jobs_after_first"].items():
        name = job.metadata["respo_verl_run"]
        assert f"{name}: already PENDING as job {job_id}" in text or f"{name}: already RUNNING as job {job_id}" in text
    # nor does the sweep that waits for them
    assert sweep["jobs_at_end"].keys() == sweep["jobs_after_first"].keys()


def test_the_waiting_sweep_reports_the_stopped_job_with_its_id_and_log_tail(sweep):
    text = sweep["wait"]
    job_id, stopped = sweep["stopped"]
    assert stopped, text[-3000:]
    assert sweep["wait_status"] == 1, text[-3000:]
    assert f"run {VESPO} failed: job {job_id} STOPPED" in text, text[-3000:]
    tail = text[text.index(f"the last lines of `ray job logs {job_id}`:") :].splitlines()[1:]
    assert tail[0].startswith("  | ") and any("ray init kwargs" in line for line in tail), text[-3000:]
    assert f"full output: {sweep['out'] / 'logs' / f'{VESPO}.out'}" in text
    assert text.rstrip().splitlines()[-1] == f"1 done, 1 failed: {VESPO}"


def test_the_succeeded_job_wrote_the_local_layout(sweep):
    """The same manifest and log layout as the local executor, the job's output saved beside the log."""
    out = sweep["out"]
    assert (out / "manifest.jsonl").is_file()
    log = read_log(out / "logs" / f"{RESPO}.jsonl")
    assert log.steps == [1, 2] and log.continuity == []
    saved = (out / "logs" / f"{RESPO}.out").read_text()
    assert "=== respo-verl sweep, Ray job" in saved and "Running entrypoint for job" in saved
    assert f"{RESPO}: job " in sweep["wait"] and " succeeded" in sweep["wait"]


def test_progress_shows_runs_done_running_failed_and_the_running_steps(sweep):
    lines = [line for line in sweep["wait"].splitlines() if " running, " in line]
    assert any(f"({RESPO} step " in line for line in lines), sweep["wait"][-3000:]
    # the steps the stopped run will not make are left out of the sweep's total: nothing is left
    assert lines[-1].startswith("1 done, 0 running, 1 failed of 2 runs | 2 of 2 steps of the sweep | ")
    assert lines[-1].endswith("~00:00 left"), lines[-1]
