"""The Ray executor of ``respo-verl sweep --ray ADDRESS``: each incomplete run as one Ray job, through Ray's Job
Submission SDK (``ray.job_submission.JobSubmissionClient``; the address is the cluster's dashboard).

The sweep never overfills the cluster: a run is submitted only while its GPU slots (``grid.job_gpus``: verl's
``trainer.nnodes x trainer.n_gpus_per_node``) fit in the cluster's GPUs less those of every running or pending job of a
respo-verl sweep (each job carries its slots in its metadata, so two sweeps sharing a cluster count each other's), and
while fewer than ``--max-running K`` runs of this sweep are. The others wait in the manifest's order and are submitted
as runs end; ``--no-wait`` submits those that fit and leaves the rest to the same command run again. verl checks at
its start that the cluster has its GPUs free and stops otherwise; a job that is not a sweep's is not counted.

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
GPUS_KEY = "respo_verl_gpus"  # job metadata: the GPU slots the run takes, counted by every sweep on the cluster
ACTIVE = ("PENDING", "RUNNING")
POLL_S = 5.0
# A head that has just started answers on its dashboard before its job agent is up, and refuses a submission with
# "No available agent to submit job, please try again later": the sweep tries again for this long.
NO_AGENT = "No available agent to submit job"
AGENT_WAIT_S = 120.0
AGENT_RETRY_S = 2.0
NODES_LIMIT = 10_000  # the nodes, dead ones included, listed at most (the most Ray's state API allows)


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


def cluster_gpus(client) -> int:
    """The GPUs of the cluster's alive nodes (Ray's ``GPU`` resource; on a CPU cluster the fake slots its nodes
    were started with), through Ray's state API on the dashboard the client talks to."""
    from ray.util.state import list_nodes

    try:
        # every node, filtered here: Ray's state API takes the nodes a server-side filter leaves out (a cluster's dead
        # ones) for output it lost, and raises
        nodes = list_nodes(address=client.get_address(), detail=True, limit=NODES_LIMIT)
    except Exception as exc:  # the state API's RayStateApiException, a dashboard that went away
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterError(f"cannot read the GPUs of the Ray cluster at {client.get_address()}: {cause}") from None
    return int(sum((node.resources_total or {}).get("GPU", 0) for node in nodes if node.state == "ALIVE"))


def gpus_taken(client) -> int:
    """The GPU slots of the cluster's PENDING and RUNNING jobs of any respo-verl sweep (their :data:`GPUS_KEY`)."""
    return sum(int((job.metadata or {}).get(GPUS_KEY, 0)) for job in client.list_jobs() if _status(job) in ACTIVE)


class RaySweep:
    """The runs of one sweep on a Ray cluster: which wait, which run as which job, and the submission of the
    waiting ones while their GPU slots fit (see the module docstring).

    Args:
        records: the sweep's runs, in the manifest's order (the order waiting runs are submitted in).
        gpus: the GPU slots of each run, by name.
        out_dir: the sweep's folder.
        client: Ray's JobSubmissionClient (or one with its methods).
        max_running: at most this many runs of this sweep at once (``--max-running``), or None.
    """

    def __init__(self, records: list[RunRecord], gpus: dict[str, int], out_dir: Path, client, max_running=None):
        self.records, self.gpus, self.out_dir, self.client = records, gpus, out_dir, client
        self.max_running = max_running
        self.job_ids: dict[str, str] = {}  # the runs submitted or found active: the job each is waited on by
        self.waiting: list[RunRecord] = []
        self.capacity = 0

    def find(self) -> list[Outcome]:
        """Sort the runs: complete (skipped), with a PENDING/RUNNING job of this folder (waited on), or waiting.

        Raises :class:`ClusterError` when a waiting run needs more GPU slots than the whole cluster has.
        """
        existing = jobs_of_sweep(self.client, self.out_dir)
        outcomes = []
        for record in self.records:
            active = [j for j in existing.get(record.name, []) if _status(j) in ACTIVE]
            if is_complete(record, self.out_dir):
                outcomes.append(Outcome(record.name, Status.SKIPPED, "skipped: log complete"))
            elif active:
                job = active[-1]
                self.job_ids[record.name] = job.submission_id
                line = f"already {_status(job)} as job {job.submission_id}"
                outcomes.append(Outcome(record.name, Status.SUBMITTED, line))
            else:
                self.waiting.append(record)
        self._check_fits()
        return outcomes

    def _check_fits(self) -> None:
        """Raise :class:`ClusterError` when a waiting run needs more GPU slots than the whole cluster has (read
        now): it would wait for ever."""
        self.capacity = cluster_gpus(self.client)
        too_big = [r for r in self.waiting if self.gpus[r.name] > self.capacity]
        if too_big:
            more = f" (and {len(too_big) - 1} more runs)" if len(too_big) > 1 else ""
            raise ClusterError(
                f"run {too_big[0].name}{more} needs {self.gpus[too_big[0].name]} GPU slots (trainer.nnodes x "
                f"trainer.n_gpus_per_node), but the Ray cluster at {self.client.get_address()} has {self.capacity}: "
                "choose a preset for this cluster"
            )

    def submit_fitting(self) -> list[Outcome]:
        """Submit waiting runs, in order, while the next one's GPU slots fit and ``max_running`` allows (both
        counted from the cluster's jobs as they are now)."""
        if not self.waiting:
            return []
        self._check_fits()
        taken = gpus_taken(self.client)
        running = sum(_status(j) in ACTIVE for jobs in jobs_of_sweep(self.client, self.out_dir).values() for j in jobs)
        outcomes = []
        while self.waiting:
            need = self.gpus[self.waiting[0].name]
            if (self.max_running is not None and running >= self.max_running) or taken + need > self.capacity:
                break
            outcomes.append(self._submit_run(self.waiting.pop(0)))
            taken, running = taken + need, running + 1
        return outcomes

    def _submit_run(self, record: RunRecord) -> Outcome:
        # The job's file logger appends to <out>/logs/<run>.jsonl: its folder exists before the job starts, on a
        # fresh --out too (the logger also makes it, on whichever node the driver runs).
        output_path(record, self.out_dir).parent.mkdir(parents=True, exist_ok=True)
        attempts = len(jobs_of_sweep(self.client, self.out_dir).get(record.name, []))
        wanted = submission_id(record, self.out_dir, attempts + 1)
        metadata = {RUN_KEY: record.name, OUT_KEY: _folder(self.out_dir), GPUS_KEY: str(self.gpus[record.name])}
        try:
            job_id = _submit(self.client, entrypoint=shell_line(record), submission_id=wanted, metadata=metadata)
        except RuntimeError as exc:  # the submission id exists: another sweep submitted this attempt just now
            if "already exists" not in str(exc):
                raise
            self.job_ids[record.name] = wanted
            return Outcome(record.name, Status.SUBMITTED, f"already submitted as job {wanted}")
        self.job_ids[record.name] = job_id
        return Outcome(record.name, Status.SUBMITTED, f"submitted as job {job_id}")

    def waiting_outcomes(self) -> list[Outcome]:
        """The runs left waiting, for ``--no-wait``."""
        line = (
            f"waiting: its {{gpus}} GPU slots are not free ({gpus_taken(self.client)} of the cluster's {self.capacity} "
            "are taken by sweeps' jobs) or --max-running is reached; the same command submits it once a run has ended"
        )
        return [Outcome(r.name, Status.WAITING, line.format(gpus=self.gpus[r.name])) for r in self.waiting]


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


def wait_for_runs(sweep: RaySweep, stream=None, interactive=None) -> list[Outcome]:
    """Wait for the sweep's jobs with a progress line, submitting waiting runs as GPU slots free up; one outcome per
    run of ``sweep.records``."""
    records, out_dir, client = sweep.records, sweep.out_dir, sweep.client
    by_name = {r.name: r for r in records}
    progress = SweepProgress(records, sum(logged_steps(r, out_dir) for r in records), stream, interactive)
    ended: dict[str, Outcome] = {}
    try:
        while True:
            for outcome in sweep.submit_fitting():
                progress.write(f"{outcome.name}: {outcome.line}")
            running = []
            for name, job_id in list(sweep.job_ids.items()):
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
                is_complete(r, out_dir) for r in records if r.name not in sweep.job_ids
            )
            failed = sum(o.status is Status.FAILED for o in ended.values())
            desc = f"{done} done, {len(running)} running, {len(sweep.waiting)} waiting, {failed} failed of "
            desc += f"{len(records)} runs"
            if running:
                desc += f" ({'; '.join(running)})"
            progress.show(desc, sum(logged_steps(r, out_dir) for r in records))
            if len(ended) == len(sweep.job_ids) and not sweep.waiting:
                break
            time.sleep(POLL_S)
    finally:
        progress.close()
    return ended_outcomes(records, ended, out_dir)


def run_on_ray(
    records: list[RunRecord],
    gpus: dict[str, int],
    out_dir: Path,
    client,
    max_running: int | None = None,
    wait: bool = True,
    echo=print,
) -> list[Outcome]:
    """Submit the sweep's incomplete runs that fit on the cluster and, with ``wait``, wait for them and submit the
    others as runs end (see the module docstring).

    Raises:
        ClusterError: a run needs more GPU slots than the cluster has, or the cluster cannot be read.
    """
    sweep = RaySweep(records, gpus, out_dir, client, max_running)
    found = sweep.find()
    submitted = sweep.submit_fitting()
    left = [] if wait else sweep.waiting_outcomes()
    for outcome in [*found, *submitted, *left]:
        echo(f"{outcome.name}: {outcome.line}")
    if not wait:
        return [*found, *submitted, *left]
    return wait_for_runs(sweep)
