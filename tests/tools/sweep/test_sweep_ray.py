"""``respo-verl sweep --ray ADDRESS`` against a real Ray cluster: a head started here with ``ray start --head`` and its
dashboard (the Job Submission API, tests/support/ray_head.py), the runs submitted as real Ray jobs. Nothing is
mocked.

Why the runs are the stand-in program (tests/support/standin/standin_run.py, started by tests/support/standin_sweep.py,
the real sweep with only the run's module changed): what is tested here is the Ray Jobs executor (submission, no
duplicates, waiting, a stopped job reported, the local layout written), which does not depend on what a job computes; a
verl job costs about 70 CPU seconds and a Ray cluster of its own, the stand-in a second. The one real sweep of verl runs
is the demo's, in tests/cpu/test_demo.py.

One grid of two runs, ReSPO and VESPO at N = 2 (2 steps each, 6 s and a minute long), shared by the module's
tests: submitted with ``--no-wait``, submitted again at once with ``--no-wait`` (nothing is duplicated), then a
third sweep waits for the jobs while the test stops VESPO's job through the SDK: ReSPO's job succeeds, VESPO's is
reported with its job id and the tail of its ``ray job logs``.

Then, on the same head (2 GPU slots), the sweep never overfills the cluster: three runs of one slot each, whose
stand-in (tests/tools/sweep/standin_gpu/standin_gpu_run.py) holds its slot in a placement group as verl holds its
pool, all finish, at most two at once and two at once at least once, counted from the jobs' own start and end times.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.ray_head import ray_head
from support.standin_sweep import STANDIN_PATH, STANDIN_SWEEP

from respo_verl.tools.runs.logs import read_log
from respo_verl.tools.sweep.rayjobs import GPUS_KEY, OUT_KEY, RUN_KEY

pytestmark = pytest.mark.slow

RESPO, VESPO = "cpu-respo-n2-s0", "cpu-vespo-n2-s0"
STEPS = 2
TIMEOUT_S = 300
STARTED = "standin: {name} starts"
GPU_STANDIN_PATH = str(Path(__file__).resolve().parent / "standin_gpu")
# The sweep of tests/support/standin_sweep.py with the stand-in that holds its GPU slots as its runs' module.
GPU_SWEEP = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); import standin_sweep; "
    "standin_sweep.MODULE = 'standin_gpu_run'; sys.exit(standin_sweep.main(sys.argv[1:]))"
)
ONE_SLOT = ("trainer.nnodes=1", "trainer.n_gpus_per_node=1")  # each run's GPU slots, which --no-compose cannot compose


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT")}
    env.update(HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    # a job's `python` is the one on the cluster's PATH (this environment's), and the stand-in is on its PYTHONPATH
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STANDIN_PATH, GPU_STANDIN_PATH, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def head():
    with ray_head(_env()) as address:
        yield address


def _argv(address: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, STANDIN_SWEEP, "--ray", address, *extra, "--out", str(out),
        "--model", "cpu", "--algos", "respo,vespo", "--reuse", "2", "--seeds", "0", "--mini-batch", "2",
        "--optimizer-steps", str(2 * STEPS), "--no-compose", "--", *ONE_SLOT, "+standin.step_s=6",
        f"+standin.slow={VESPO}@60",
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

            def ready() -> bool:  # the waiting sweep has found the job, and the job's program is up (output to report)
                started = STARTED.format(name=VESPO) in client.get_job_logs(job_id)
                return f"{VESPO}: already" in waiting.read_text() and started

            while not ready() and waiter.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
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
        assert " python -m standin_run algorithm=" in job.entrypoint


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
    assert tail[0].startswith("  | ") and any(STARTED.format(name=VESPO) in line for line in tail), text[-3000:]
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
    assert STARTED.format(name=RESPO) in saved and f"standin: {RESPO} ran {STEPS} steps" in saved
    assert f"{RESPO}: job " in sweep["wait"] and " succeeded" in sweep["wait"]


def test_progress_shows_runs_done_running_failed_and_the_running_steps(sweep):
    lines = [line for line in sweep["wait"].splitlines() if " running, " in line]
    assert any(f"({RESPO} step " in line for line in lines), sweep["wait"][-3000:]
    # the steps the stopped run will not make are left out of the sweep's total: nothing is left
    assert lines[-1].startswith("1 done, 0 running, 0 waiting, 1 failed of 2 runs | 2 of 2 steps of the sweep | ")
    assert lines[-1].endswith("~00:00 left"), lines[-1]


def _most_at_once(spans: list[tuple[int, int]]) -> int:
    """The most of the (start, end) spans that overlap at one moment (an end before a start at the same time)."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, change in events:
        now += change
        most = max(most, now)
    return most


def test_a_sweep_runs_at_most_as_many_runs_at_once_as_the_clusters_gpus_hold(head, tmp_path):
    from ray.job_submission import JobSubmissionClient

    out = tmp_path / "out"
    argv = [
        sys.executable, "-c", GPU_SWEEP, str(Path(STANDIN_SWEEP).parent), "--ray", head, "--out", str(out),
        "--model", "gpu", "--algos", "respo", "--reuse", "2", "--seeds", "0,1,2", "--mini-batch", "2",
        "--optimizer-steps", str(2 * STEPS), "--no-compose", "--", *ONE_SLOT, "+standin.step_s=4",
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert text.rstrip().splitlines()[-1] == "3 done", text[-3000:]
    jobs = list(_jobs(JobSubmissionClient(head), out).values())
    assert sorted(j.metadata[RUN_KEY] for j in jobs) == [f"gpu-respo-n2-s{seed}" for seed in range(3)]
    assert {str(j.status.value) for j in jobs} == {"SUCCEEDED"} and {j.metadata[GPUS_KEY] for j in jobs} == {"1"}
    assert _most_at_once([(j.start_time, j.end_time) for j in jobs]) == 2, [(j.start_time, j.end_time) for j in jobs]
    # the third run waited, and the sweep said so
    assert any(" running, 1 waiting, " in line for line in text.splitlines()), text[-3000:]
    assert "gpu-respo-n2-s2: submitted as job" in text
