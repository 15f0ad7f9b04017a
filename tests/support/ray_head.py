"""A Ray head started by a test (``ray start --head`` with its dashboard, the Job Submission API), in one place.

Used by tests/tools/sweep/test_sweep_ray.py (``respo-verl sweep --ray``) and test_sweep_ray_auth.py (its token). The
caller passes the environment the head and its jobs run with: a job's ``python`` and ``PYTHONPATH`` are the head's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from respo_verl.run.reaper import reap
from support.ranks import free_port

OWN_PORTS = (
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
    "ray-client-server-port",
)


@contextmanager
def ray_head(env: dict[str, str], num_cpus: int = 16, num_gpus: int = 2) -> Iterator[str]:
    """A Ray head with its dashboard; yields the dashboard's address (``http://127.0.0.1:<port>``). Every process of
    its session is reaped afterwards (its temp dir is in their command lines)."""
    temp = tempfile.mkdtemp(prefix="rvh-", dir="/tmp")  # Ray's socket paths must stay short
    dashboard = free_port()
    # Ports of their own: Ray's fixed defaults (the job agent's 52365 above all) may be held by another cluster on
    # this machine, and then the head comes up without a job agent.
    ports = [f"--{option}={free_port()}" for option in OWN_PORTS]
    command = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={free_port()}",
        f"--dashboard-port={dashboard}", *ports, "--include-dashboard=true", f"--num-cpus={num_cpus}",
        f"--num-gpus={num_gpus}", f"--temp-dir={temp}", "--disable-usage-stats",
    ]  # fmt: skip
    try:
        # a session of its own: no terminal, so that the reaper below stops the head's processes
        started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        reap({}, temp)
        shutil.rmtree(temp, ignore_errors=True)
