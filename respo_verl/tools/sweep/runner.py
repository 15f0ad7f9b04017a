"""Running the runs of a manifest: what the executors share, and Ray jobs (the local executor: :mod:`.local`)."""

from __future__ import annotations

import enum
import os
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

from respo_verl.tools.runs.logs import LogError, read_log
from respo_verl.tools.runs.manifest import MANIFEST_NAME, RunRecord, check_name, read_manifest
from respo_verl.tools.sweep.grid import LOGGER_KEY

# How long the reachability probe of a Ray address waits for a TCP connection: a refused port answers at once, a
# dead host is not worth Ray's own 40 s of GCS retries.
PROBE_TIMEOUT_S = 5.0
# How Ray (2.52 and later) is told to send a cluster's token, and where it reads it (docs/cluster.md, "Security").
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


class ClusterError(RuntimeError):
    """The Ray cluster cannot be reached (one line naming the address and the cause; exit code 2)."""


class Status(enum.Enum):
    """What happened to one run of a sweep."""

    SKIPPED = "skipped"  # its log is complete
    RAN = "ran"
    FAILED = "failed"
    SUBMITTED = "submitted"
    WAITING = "waiting"  # not submitted: the cluster's GPU slots were taken (``--ray --no-wait``)
    INTERRUPTED = "interrupted"  # the sweep was interrupted while the run ran; the same command resumes it


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
    """The run as one shell line, environment included, with the cluster's ``python`` (as the manifest records it)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(record.env.items()))
    return f"{env} {shlex.join(record.command)}".strip()


def ended_outcomes(records: list[RunRecord], ended: dict[str, Outcome], out_dir: Path) -> list[Outcome]:
    """After a wait for a cluster's jobs: the outcome of each run of ``records`` that ended, or skipped when its log is
    complete (a run the sweep did not wait for); a run with neither has no outcome."""
    outcomes = []
    for record in records:
        if record.name in ended:
            outcomes.append(ended[record.name])
        elif is_complete(record, out_dir):
            outcomes.append(Outcome(record.name, Status.SKIPPED, "skipped: log complete"))
    return outcomes


def local_command(record: RunRecord) -> list[str]:
    """The run's command for this machine: the manifest's ``python`` is this interpreter (the sweep's environment)."""
    if record.command[:1] == ["python"]:
        return [sys.executable, *record.command[1:]]
    return list(record.command)


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a Ray address (``http://head:8265``, ``ray://head:10001``, ``head:6379``), or None when it has
    no port to probe (``auto``, a name without a port)."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:
        return None
    return (parts.hostname, port) if parts.hostname and port else None


def check_reachable(address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Open (and close) a TCP connection to ``address``'s host and port before Ray is asked to.

    Ray itself retries an unreachable GCS address for about 40 s and then raises with a long traceback; this probe
    answers in at most ``timeout`` seconds. Raises :class:`ClusterError`.
    """
    target = _host_port(address)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=timeout).close()
    except OSError as exc:
        cause = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise ClusterError(f"cannot reach the Ray cluster at {address}: {cause}") from None


def connect(address: str):
    """Ray's JobSubmissionClient for ``address``, or :class:`ClusterError` naming the address and the cause.

    Ray's client sends the cluster's token itself where token auth is on here (:data:`AUTH_MODE_ENV` ``=token``),
    read from :data:`TOKEN_ENV`, else the file :data:`TOKEN_PATH_ENV` names, else ``~/.ray/auth_token``.
    """
    check_reachable(address)
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except AuthenticationError as exc:  # no token sent (401), a token refused (403), or none readable here
        text = str(exc).strip()
        sent = "its token was refused" if text.startswith("Authentication failed") else "no token was found here"
        cause = text.splitlines()[0] if text else type(exc).__name__
        if TOKEN_PATH_ENV in cause and "cannot be opened" in cause:
            raise ClusterError(f"{TOKEN_PATH_ENV}={os.environ[TOKEN_PATH_ENV]}: no such file, or it is empty") from None
        raise ClusterError(
            f"cannot reach the Ray cluster at {address}: the cluster wants a token and {sent} (set "
            f"{AUTH_MODE_ENV}=token, and {TOKEN_ENV} or {TOKEN_PATH_ENV} to the head's token, "
            f"docs/cluster.md, Security): {cause}"
        ) from None
    except Exception as exc:  # ConnectionError (dashboard), ray.exceptions.RpcError (GCS), ValueError (address)
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterError(f"cannot reach the Ray cluster at {address}: {cause}") from None


class SweepConflict(ValueError):
    """``--out`` holds the manifest of another sweep (one line naming what differs; exit status 2)."""


def _identity(command: list[str]) -> list[str]:
    """A run's command less its trackers (``trainer.logger=``): a tracker is not part of what a run computes, so the
    same sweep with other loggers is the same sweep (the configuration hash leaves them out too,
    :func:`respo_verl.tools.sweep.grid.config_hash`)."""
    return [word for word in command if word.split("=", 1)[0].lstrip("+") != LOGGER_KEY]


def _differs(old: RunRecord, new: RunRecord) -> bool:
    return (old.config_hash, _identity(old.command), old.env) != (new.config_hash, _identity(new.command), new.env)


def _words(command: list[str], other: list[str]) -> str:
    only = [word for word in _identity(command) if word not in other]
    return " ".join(only) if only else "none"


def check_same_sweep(records: list[RunRecord], out_dir: Path) -> None:
    """Refuse ``records`` when ``out_dir`` holds the manifest of another grid or of other shared settings.

    Runs of the same name must have the same configuration hash, command line (its loggers aside: a sweep run again
    with other trackers is accepted, and its manifest then records them) and environment; a run only in one of the
    two is another grid. Raises :class:`SweepConflict` with one line naming the first difference.
    """
    path = out_dir / MANIFEST_NAME
    if not path.is_file():
        return
    try:
        old = {r.name: r for r in read_manifest(path)}
    except ValueError as exc:
        raise SweepConflict(f"--out {out_dir}: its manifest cannot be read ({exc}); --force replaces it") from None
    new = {r.name: r for r in records}
    fix = "use --force to replace it (the runs that differ start afresh), or another --out"
    if set(old) != set(new):
        only_old, only_new = sorted(set(old) - set(new)), sorted(set(new) - set(old))
        raise SweepConflict(
            f"--out {out_dir} holds another grid (runs only there: {', '.join(only_old) or 'none'}; only in this "
            f"sweep: {', '.join(only_new) or 'none'}); {fix}"
        )
    changed = [name for name in new if _differs(old[name], new[name])]
    if changed:
        first, later = old[changed[0]], new[changed[0]]
        more = f" (and {len(changed) - 1} more runs)" if len(changed) > 1 else ""
        raise SweepConflict(
            f"--out {out_dir} holds run {first.name}{more} with configuration hash {first.config_hash[:12] or 'none'}"
            f", this sweep's is {later.config_hash[:12] or 'none'} (there: {_words(first.command, later.command)}; "
            f"here: {_words(later.command, first.command)}); {fix}"
        )


def inside(path: Path, root: Path) -> bool:
    """Whether ``path``, symbolic links resolved, lies in ``root`` (resolved too)."""
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def _checkpoint_dirs(record: RunRecord) -> list[Path]:
    return [Path(a.split("=", 1)[1]) for a in record.command if a.startswith("trainer.default_local_dir=")]


def run_files(record: RunRecord, out_dir: Path, roots: tuple[Path, ...]) -> list[Path]:
    """The files a run of a manifest owns (its log, its output, its checkpoint folder) that exist; each must lie in
    one of ``roots`` (``--out`` and the sweep's checkpoint root), symbolic links resolved.

    Raises:
        SweepConflict: a path leaves every root (a planted or foreign manifest), or the run's name is not a plain name.
    """
    try:
        check_name(record.name, "run name")
    except ValueError as exc:
        raise SweepConflict(f"--out {out_dir}: its manifest has a {exc}") from None
    log = log_path(record, out_dir)
    files = []
    for source in [log, log.with_suffix(".out"), *_checkpoint_dirs(record)]:
        if not source.exists() and not source.is_symlink():
            continue
        if source.is_symlink() or not any(inside(source, root) for root in roots):
            raise SweepConflict(
                f"--out {out_dir}: its manifest names {source} for run {record.name}, which is a symbolic link or "
                f"lies outside {' and '.join(map(str, roots))}; --force moves nothing outside the sweep's own folders"
            )
        files.append(source)
    return files


def stale_files(records: list[RunRecord], out_dir: Path, checkpoints: Path | None = None) -> list[tuple[str, Path]]:
    """What ``--force`` moves: (run name, path) of every existing file of a run of ``out_dir``'s manifest that is
    not one of ``records`` unchanged, and of every run of ``records`` the manifest does not have.

    ``checkpoints`` is the sweep's checkpoint root (default ``out_dir/checkpoints``); nothing outside it and
    ``out_dir`` is ever named. Raises :class:`SweepConflict` as :func:`run_files` does.
    """
    path = out_dir / MANIFEST_NAME
    if path.is_symlink():
        raise SweepConflict(f"--out {out_dir}: {path} is a symbolic link; --force reads no manifest through one")
    try:
        old = read_manifest(path) if path.is_file() else []
    except ValueError:
        old = []
    new = {r.name: r for r in records}
    stale = [r for r in old if r.name not in new or _differs(r, new[r.name])]
    stale += [r for r in records if r.name not in {o.name for o in old}]
    roots = (out_dir, checkpoints if checkpoints is not None else out_dir / "checkpoints")
    return [(record.name, source) for record in stale for source in run_files(record, out_dir, roots)]


def replace_sweep(records: list[RunRecord], out_dir: Path, checkpoints: Path | None = None) -> Path | None:
    """Under ``--force``: move the files :func:`stale_files` names to ``out_dir/replaced-<UTC time>/<run>/``, so
    that no run of the new sweep is skipped or resumed on another configuration's files. Returns that folder, or
    None when nothing was moved. The caller holds the folder's lock (:func:`respo_verl.tools.sweep.local.folder_lock`).
    """
    files = stale_files(records, out_dir, checkpoints)
    moved_to = out_dir / f"replaced-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"
    for name, source in files:
        target = moved_to / name / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(source), str(target))
    return moved_to if files else None
