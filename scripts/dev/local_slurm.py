"""A Slurm cluster of two nodes on this host, for the tests (tests/support/local_slurm.py) and for a developer: munge,
slurmctld and two slurmd.

The nodes are ``n1`` at 127.0.0.1 and ``n2`` at 127.0.0.2 (Linux routes all of 127.0.0.0/8 to loopback), one ``gpu``
GRES each (a fake device, ``/dev/zero``: Slurm counts it and binds nothing). Every file (configuration, munge key and
socket, state, spool, logs, pid files) is in one folder; the daemons run in the foreground of their own sessions and
are stopped by their pids. Slurm's ports are picked free outside Ray's worker range (10002-19999), where ``ray start``
refuses a port that another program holds.

Process tracking is ``proctrack/linuxproc`` (a step's processes are its descendants) and tasks are not confined
(``task/none``): cgroups are what a container host forbids, and a cluster's Slurm needs them for nothing that the
launch scripts rely on (docs/cluster.md, "Slurm on one host").

From a shell (root; Debian's slurmctld, slurmd, slurm-client and munge installed): ``scripts/dev/local_slurm.sh start
DIR`` prints the ``export SLURM_CONF=...`` that points sbatch, srun, squeue and scontrol at it; ``... stop DIR``.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

NODES = {"n1": "127.0.0.1", "n2": "127.0.0.2"}
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default --min-worker-port..--max-worker-port
PORT_RANGE = range(20000, 32000)  # above Ray's worker range, below Linux's ephemeral ports (32768-60999)
SRUN_PORTS = "61000-62000"  # srun's own listeners: above Linux's ephemeral ports too
STARTUP_S = 60  # munge, slurmctld and two slurmd on a busy 2-core machine
PIDS = "pids.json"


def missing() -> str | None:
    """Why a local Slurm cannot start here, or None. As root, installs Debian's packages when a program is missing."""
    if os.geteuid() != 0:
        return "a local Slurm needs root (slurmd starts each job as its user; munged and slurmctld run as root)"
    absent = [p for p in PROGRAMS if shutil.which(p) is None]
    if absent and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
        for cmd in (["apt-get", "update", "-qq"], install):
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
            if res.returncode != 0:
                return f"{' '.join(cmd)} failed (exit {res.returncode}): {res.stderr.strip()[-300:]}"
        absent = [p for p in PROGRAMS if shutil.which(p) is None]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing; Debian: apt-get install {' '.join(PACKAGES)})"
    return None


def _free_ports(count: int) -> list[int]:
    """``count`` ports of PORT_RANGE that nothing listens on, neither at 127.0.0.1 nor at 127.0.0.2."""
    found: list[int] = []
    for port in random.sample(PORT_RANGE, len(PORT_RANGE)):
        try:
            for address in NODES.values():
                with socket.socket() as sock:
                    sock.bind((address, port))
        except OSError:
            continue
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"no {count} free ports in {PORT_RANGE}")


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive ports of PORT_RANGE that are free now (a Ray's GCS, dashboard and each
    node's own ports: outside Ray's worker range, where ``ray start`` refuses them)."""
    for start in random.sample(range(PORT_RANGE.start, PORT_RANGE.stop - count), 200):
        try:
            for port in range(start, start + count):
                for address in NODES.values():
                    with socket.socket() as sock:
                        sock.bind((address, port))
        except OSError:
            continue
        return start
    raise RuntimeError(f"no {count} consecutive free ports in {PORT_RANGE}")


class LocalSlurm:
    """Two Slurm nodes on this host, all state in ``folder``. ``env`` is the environment its clients need."""

    def __init__(self, folder: Path):
        self.folder = Path(folder).resolve()
        self.conf = self.folder / "slurm.conf"
        self.log_dir = self.folder / "log"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # --- start and stop ------------------------------------------------------------------------------------------

    def start(self) -> LocalSlurm:
        for sub in ("munge", "state", "log", "spool"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o755)  # slurmd and the jobs read the configuration; munged checks its folders
        key = self.folder / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        (self.folder / "munge").chmod(0o700)
        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        self._write_conf(ctld_port, node_ports)
        pids: dict[str, int] = {}
        try:
            munge = self.folder / "munge"
            pids["munged"] = self._daemon(
                "munged",
                ["munged", "--foreground", "--force", f"--socket={munge / 'munge.sock'}", f"--key-file={key}",
                 f"--pid-file={munge / 'munged.pid'}", f"--log-file={self.log_dir / 'munged.log'}",
                 f"--seed-file={munge / 'munged.seed'}"],
            )  # fmt: skip
            self._wait(lambda: (munge / "munge.sock").exists(), "munged's socket", pids)
            pids["slurmctld"] = self._daemon("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
            for node in NODES:
                (self.folder / "spool" / node).mkdir(exist_ok=True)
                cmd = ["slurmd", "-D", "-f", str(self.conf), "-N", node]
                pids[f"slurmd-{node}"] = self._daemon(f"slurmd-{node}", cmd)
            (self.folder / PIDS).write_text(json.dumps(pids))
            self._wait(self._nodes_idle, "both nodes idle (sinfo)", pids)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_conf(self, ctld_port: int, node_ports: list[int]) -> None:
        d = self.folder
        lines = [
            "ClusterName=respo-local",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_ports[0]}",
            f"SrunPortRange={SRUN_PORTS}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d / 'munge' / 'munge.sock'}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool' / '%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.%n.pid'}",
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log_dir / 'slurmd.%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # the nodes' CPUs as written, whatever this host has
            "KillWait=5",  # seconds between a job's SIGTERM and SIGKILL (default 30)
            "MinJobAge=300",  # a finished job stays visible to scontrol this long (there is no accounting)
            "GresTypes=gpu",
            "InactiveLimit=0",
        ]
        for (node, address), port in zip(NODES.items(), node_ports, strict=True):
            # 64 logical CPUs, the template's --cpus-per-task (config_overrides: Slurm does not count them)
            lines.append(f"NodeName={node} NodeAddr={address} NodeHostname=localhost Port={port} CPUs=64 Gres=gpu:1")
        lines.append(f"PartitionName=local Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        # A GRES needs a device file to be counted; /dev/zero stands in for a GPU.
        (d / "gres.conf").write_text(f"NodeName={','.join(NODES)} Name=gpu Count=1 File=/dev/zero\n")

    def _daemon(self, name: str, cmd: list[str]) -> int:
        with open(self.log_dir / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=self.env)  # fmt: skip
        return proc.pid

    def _wait(self, ready, what: str, pids: dict[str, int]) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if ready():
                return
            for name, pid in pids.items():
                if not _alive(pid):
                    raise RuntimeError(f"local Slurm: {name} ended at start: {self._tail(name)}")
            time.sleep(0.2)
        raise RuntimeError(f"local Slurm: no {what} after {STARTUP_S} s; logs in {self.log_dir}")

    def _tail(self, name: str) -> str:
        lines = []
        for log in sorted(self.log_dir.glob(f"{name.replace('-', '.')}*")) + sorted(self.log_dir.glob(f"{name}*")):
            lines += log.read_text(errors="replace").splitlines()[-5:]
        return " | ".join(lines)

    def _nodes_idle(self) -> bool:
        res = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(node) == "idle" for node in NODES)

    def stop(self) -> None:
        """Cancel every job of this cluster, wait for them to end, then stop the daemons by their pids."""
        pids_file = self.folder / PIDS
        pids = json.loads(pids_file.read_text()) if pids_file.is_file() else {}
        if pids.get("slurmctld") and _alive(pids["slurmctld"]):
            self.run(["scancel", "--full", "--user=root"], check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(0.5)
        for name in sorted(pids, key=lambda n: n == "munged"):  # munged last: the others' shutdown needs it
            _end(pids[name])
        pids_file.unlink(missing_ok=True)

    # --- clients ---------------------------------------------------------------------------------------------------

    def run(self, cmd: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.env)
        return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60, **kwargs)

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit a job with the environment ``env`` (default: this process's), which it inherits; its id."""
        res = self.run(
            ["sbatch", "--parsable", *args], env={**(env or os.environ), "SLURM_CONF": str(self.conf)}, cwd=cwd
        )
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, NodeList, ...), or {} once it is forgotten."""
        res = self.run(["scontrol", "show", "job", "--oneliner", job_id], check=False)
        fields = {}
        for item in res.stdout.split():
            key, sep, value = item.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float, what: str = "") -> dict[str, str]:
        """Wait until the job is in one of ``states``; its fields then."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} not {'/'.join(states)} after {timeout} s {what}: {fields}")

    def logs(self) -> str:
        """The last lines of slurmctld's and each slurmd's log, for a failing test's message."""
        parts = []
        for log in sorted(self.log_dir.glob("*.log")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a child of this process that ended but was not reaped yet
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def _end(pid: int, bound: float = 10) -> None:
    """SIGTERM to ``pid``, SIGKILL after ``bound`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.1)


def main(argv: list[str]) -> int:
    usage = "usage: local_slurm.sh start DIR | stop DIR"
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(usage, file=sys.stderr)
        return 2
    slurm = LocalSlurm(Path(argv[1]))
    if argv[0] == "stop":
        slurm.stop()
        print(f"local Slurm in {slurm.folder} stopped")
        return 0
    why = missing()
    if why:
        print(f"local_slurm.sh: {why}", file=sys.stderr)
        return 2
    slurm.start()
    print(f"local Slurm up: nodes {', '.join(f'{n} at {a}' for n, a in NODES.items())}; logs in {slurm.log_dir}")
    print(f"export SLURM_CONF={slurm.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
