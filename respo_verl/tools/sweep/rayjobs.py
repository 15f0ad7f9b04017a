"""The Ray executor of ``respo-verl sweep --ray ADDRESS``: each incomplete run as one Ray job, through Ray's Job
Submission SDK (``ray.job_submission.JobSubmissionClient``; the address is the cluster's dashboard).

A job's entrypoint is the run's manifest line with its environment in front (``runner.shell_line``), not a job
``runtime_env``: verl's driver calls ``ray.init`` with a runtime env that carries its own ``VERL_*`` variables, and
Ray refuses to merge a job's runtime env holding the same keys. Submission ids, waiting, reports and logs:
docs/comparing.md, "`respo-verl sweep`: the grid as verl runs" (As Ray jobs).
"""

from __future__ import annotations

import hashlib
import time
from datetime import datetime, timezone
from pathlib import Path

from respo_verl.tools.runs.manifest import RunRecord
from respo_verl.tools.sweep.local import failure_report, logged_steps, output_path
from respo_verl.tools.sweep.progress import SweepProgress
from respo_verl.tools.sweep.runner import ClusterError, Outcome, Status, ended_outcomes, is_complete, shell_line

RUN_KEY = "respo_verl_run"  # job metadata: the run's name
OUT_KEY = "respo_verl_out"  # job metadata: the sweep's folder (resolved), so sweeps sharing a cluster stay apart
ACTIVE = ("PENDING", "RUNNING")
POLL_S = 5.0
# A head that has just started answers on its dashboard before its job agent is up, and refuses a submission with
# "No available agent to submit job, please try again later": the sweep tries again for this long.
NO_AGENT = "No available agent to submit job"
AGENT_WAIT_S = 120.0
AGENT_RETRY_S = 2.0


def _status(job) -> str:
    return str(getattr(job.status, "value", job.status))


def _folder(out_dir: Path) -> str:
    return str(out_dir.resolve())


def jobs_of_sweep(client, out_dir: Path) -> dict[str, list]:
    """The cluster's jobs of this sweep folder, by run name, oldest first."""
    folder = _folder(out_dir)
    by_run: dict[str, list] = {}
    for job in client.list_jobs():
        metadata = job.metadata or {}
        if metadata.get(OUT_KEY) == folder and metadata.get(RUN_KEY):
            by_run.setdefault(metadata[RUN_KEY], []).append(job)
    for jobs in by_run.values():
        jobs.sort(key=lambda j: j.start_time or 0)
    return by_run


def submission_id(record: RunRecord, out_dir: Path, attempt: int) -> str:
    digest = hashlib.sha256(_folder(out_dir).encode()).hexdigest()[:8]
    return f"{record.name}-{digest}-{attempt}"


def submit_runs(records: list[RunRecord], out_dir: Path, client) -> tuple[list[Outcome], dict[str, str]]:
    """Submit every incomplete run without a PENDING/RUNNING job of this folder.

    Returns the outcomes (skipped, submitted, or already submitted) and the job id each run is waited on by.
    """
    existing = jobs_of_sweep(client, out_dir)
    outcomes, job_ids = [], {}
    for record in records:
        jobs = existing.get(record.name, [])
        active = [j for j in jobs if _status(j) in ACTIVE]
        if is_complete(record, out_dir):
            outcomes.append(Outcome(record.name, Status.SKIPPED, "skipped: log complete"))
            continue
        if active:
            job = active[-1]
            job_ids[record.name] = job.submission_id
            outcomes.append(
                Outcome(record.name, Status.SUBMITTED, f"already {_status(job)} as job {job.submission_id}")
            )
            continue
        # The job's file logger appends to <out>/logs/<run>.jsonl: its folder exists before the job starts, on a
        # fresh --out too (the logger also makes it, on whichever node the driver runs).
        output_path(record, out_dir).parent.mkdir(parents=True, exist_ok=True)
        wanted = submission_id(record, out_dir, len(jobs) + 1)
        try:
            job_id = _submit(
                client,
                entrypoint=shell_line(record),
                submission_id=wanted,
                metadata={RUN_KEY: record.name, OUT_KEY: _folder(out_dir)},
            )
        except RuntimeError as exc:  # the submission id exists: another sweep submitted this attempt just now
            if "already exists" not in str(exc):
                raise
            job_id = wanted
            outcomes.append(Outcome(record.name, Status.SUBMITTED, f"already submitted as job {job_id}"))
        else:
            outcomes.append(Outcome(record.name, Status.SUBMITTED, f"submitted as job {job_id}"))
        job_ids[record.name] = job_id
    return outcomes, job_ids


def _submit(client, wait_s: float = AGENT_WAIT_S, **job) -> str:
    """``client.submit_job(**job)``, tried again while the head has no job agent yet (for up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as exc:
            if NO_AGENT not in str(exc):
                raise
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"the Ray head had no job agent for {wait_s:.0f} s (is its dashboard agent running?): {exc}"
                ) from exc
        time.sleep(AGENT_RETRY_S)


def _save_output(client, record: RunRecord, out_dir: Path, job_id: str) -> tuple[Path, str]:
    """Append the job's output to the run's output file; returns the file and the output."""
    text = client.get_job_logs(job_id)
    path = output_path(record, out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    with path.open("a") as fh:
        fh.write(f"=== respo-verl sweep, Ray job {job_id}, saved {stamp}\n{text}")
        if text and not text.endswith("\n"):
            fh.write("\n")
    return path, text


def wait_for_runs(
    records: list[RunRecord], out_dir: Path, client, job_ids: dict[str, str], stream=None, interactive=None
) -> list[Outcome]:
    """Wait for the jobs of ``job_ids`` with a progress line; one outcome per run of ``records``."""
    by_name = {r.name: r for r in records}
    progress = SweepProgress(records, sum(logged_steps(r, out_dir) for r in records), stream, interactive)
    ended: dict[str, Outcome] = {}
    try:
        while True:
            running = []
            for name, job_id in job_ids.items():
                if name in ended:
                    continue
                record, job = by_name[name], client.get_job_info(job_id)
                logged = logged_steps(record, out_dir)
                if _status(job) in ACTIVE:
                    running.append(f"{name} step {logged} of {record.last_log_step}")
                    continue
                output, text = _save_output(client, record, out_dir, job_id)
                if _status(job) == "SUCCEEDED" and is_complete(record, out_dir):
                    ended[name] = Outcome(name, Status.RAN, f"ran as job {job_id}: {record.last_log_step} steps")
                    progress.write(f"{name}: job {job_id} succeeded")
                else:
                    ended[name] = Outcome(name, Status.FAILED, f"failed: job {job_id} {_status(job)}")
                    message = f" ({job.message.strip().splitlines()[0]})" if (job.message or "").strip() else ""
                    how, source = f"job {job_id} {_status(job)}{message}", f"`ray job logs {job_id}`"
                    progress.write(failure_report(record, how, logged, text, output, source))
                    progress.drop(record.last_log_step - logged)
            done = sum(o.status is Status.RAN for o in ended.values()) + sum(
                is_complete(r, out_dir) for r in records if r.name not in job_ids
            )
            failed = sum(o.status is Status.FAILED for o in ended.values())
            desc = f"{done} done, {len(running)} running, {failed} failed of {len(records)} runs"
            if running:
                desc += f" ({'; '.join(running)})"
            progress.show(desc, sum(logged_steps(r, out_dir) for r in records))
            if len(ended) == len(job_ids):
                break
            time.sleep(POLL_S)
    finally:
        progress.close()
    return ended_outcomes(records, ended, out_dir)


def run_on_ray(records: list[RunRecord], out_dir: Path, client, wait: bool = True, echo=print) -> list[Outcome]:
    """Submit the sweep's incomplete runs and, with ``wait``, wait for them (see the module docstring)."""
    submitted, job_ids = submit_runs(records, out_dir, client)
    for outcome in submitted:
        echo(f"{outcome.name}: {outcome.line}")
    if not wait:
        return submitted
    return wait_for_runs(records, out_dir, client, job_ids)
