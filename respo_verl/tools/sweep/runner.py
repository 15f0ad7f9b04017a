"""Running the runs of a manifest: one after another here, printed for a scheduler, or as Ray jobs."""

from __future__ import annotations

import enum
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from respo_verl.tools.runs.logs import LogError, read_log
from respo_verl.tools.runs.manifest import RunRecord


class Status(enum.Enum):
    """What happened to one run of a sweep."""

    SKIPPED = "skipped"  # its log is complete
    RAN = "ran"
    FAILED = "failed"
    SUBMITTED = "submitted"


@dataclass(frozen=True)
class Outcome:
    """One run's outcome; :attr:`line` is how the sweep prints it after the run's name."""

    name: str
    status: Status
    line: str


def log_path(record: RunRecord, out_dir: Path) -> Path:
    log = Path(record.log)
    return log if log.is_absolute() else out_dir / log


def is_complete(record: RunRecord, out_dir: Path) -> bool:
    """A run is complete when its log holds every step up to its planned last step (a log that starts late or has a
    gap is not complete, whatever its last step)."""
    path = log_path(record, out_dir)
    if not path.exists():
        return False
    try:
        return read_log(path).complete_through(record.last_log_step)
    except LogError:
        return False


def shell_line(record: RunRecord) -> str:
    """The run as one shell line, environment included."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(record.env.items()))
    return f"{env} {shlex.join(record.command)}".strip()


def _skipped(record: RunRecord) -> Outcome:
    return Outcome(record.name, Status.SKIPPED, "skipped: log complete")


def run_locally(records: list[RunRecord], out_dir: Path, echo=print) -> list[Outcome]:
    """Run incomplete runs one after another; one :class:`Outcome` per run. Stops at the first failure."""
    outcomes = []
    for record in records:
        if is_complete(record, out_dir):
            outcomes.append(_skipped(record))
            continue
        log_path(record, out_dir).parent.mkdir(parents=True, exist_ok=True)
        echo(f"[respo-verl sweep] {record.name}: {shell_line(record)}")
        done = subprocess.run(record.command, env={**os.environ, **record.env}, check=False)
        if done.returncode != 0:
            outcomes.append(Outcome(record.name, Status.FAILED, f"failed with exit code {done.returncode}"))
            break
        outcomes.append(Outcome(record.name, Status.RAN, "ran"))
    return outcomes


def submit_to_ray(records: list[RunRecord], out_dir: Path, address: str, client=None) -> list[Outcome]:
    """Submit incomplete runs as Ray jobs to the cluster at ``address`` (its dashboard, e.g. http://head:8265).

    The submission id is the run name, so submitting a sweep twice is refused by Ray for runs already submitted.
    """
    if client is None:
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(address)
    outcomes = []
    for record in records:
        if is_complete(record, out_dir):
            outcomes.append(_skipped(record))
            continue
        job_id = client.submit_job(
            entrypoint=shlex.join(["python", *record.command[1:]]),
            submission_id=record.name,
            runtime_env={"env_vars": dict(record.env)},
        )
        outcomes.append(Outcome(record.name, Status.SUBMITTED, f"submitted as {job_id}"))
    return outcomes
