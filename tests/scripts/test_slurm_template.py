"""The Slurm template, scripts/launch/slurm/respo_verl.sbatch, submitted with real ``sbatch`` to a Slurm of two
nodes on this host (scripts/dev/local_slurm.py: n1 at 127.0.0.1, n2 at 127.0.0.2, proctrack/linuxproc).

All real: Slurm's daemons and clients, the template, ``scripts/launch/ray_cluster.sh`` starting Ray on both nodes in
``srun`` steps, the planner. The run (``SCRIPT``) is a small program instead of verl's trainer: it joins the job's
Ray cluster and checks that it has both nodes, each at its own address (the suite's time has no room for another
verl driver; verl across two Ray nodes on one host is tests/cpu/test_two_nodes.py).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from support.local_slurm import NODES, free_port_block, start_or_skip, time_limit_past_notice
from support.procs import naming, wait_gone

# a Slurm and a two-node Ray cluster (about 30 s)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts/launch/slurm/respo_verl.sbatch"
# The run: joins the cluster at RAY_ADDRESS (the template sets it), prints the alive nodes' addresses, and fails
# unless there are two, at two addresses.
PROBE = """#!/usr/bin/env bash
exec python3 - "$@" <<'EOF'
import os
import sys

import ray

ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
alive = sorted(node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"])
print("probe: args", *sys.argv[1:])
print("probe: nodes", *alive, flush=True)
sys.exit(0 if len(set(alive)) == 2 else 1)
EOF
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = start_or_skip(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def test_sbatch_starts_ray_on_both_nodes_runs_the_script_on_the_head_and_leaves_no_ray(slurm, tmp_path):
    probe = tmp_path / "probe.sh"
    probe.write_text(PROBE)
    ray_tmp = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    base = free_port_block(2 + 10 * len(NODES))
    env = {
        **{k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"},  # the nodes read the template's token file
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "SCRIPT": str(probe),
        "RAY_AUTH_TOKEN_PATH": str(tmp_path / "token"),  # the template makes it
        "NUM_GPUS": "1",
        "NUM_CPUS": "8",
        "RAY_PORT": str(base),
        "DASHBOARD_PORT": str(base + 1),
        "RAY_NODE_PORTS": str(base + 2),
        "RAY_TMPDIR": str(ray_tmp),
        "RAY_START_ARGS": "--disable-usage-stats",
    }
    out = tmp_path / "job.out"
    try:
        # a time limit past the template's pre-emption notice: a notice due at once would requeue the job
        limit = time_limit_past_notice(SBATCH)
        job = slurm.sbatch("--nodes=2", "--gpus-per-node=1", limit, f"--output={out}", str(SBATCH), env=env, cwd=ROOT)
        fields = slurm.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout=240)
        text = out.read_text() if out.is_file() else ""
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-4000:] + slurm.logs()
        assert fields["Restarts"] == "0" and "requeue" not in text, text[-4000:]  # Ray's stop is no pre-emption
        assert "OK: every rule holds" in text  # the planner ran for the allocation first
        # Ray on each node at its own address from Slurm (NodeAddr), with its own ports, the head's step holding it
        head, worker = NODES.values()
        assert f" ray start --head --port={base} --num-gpus=1 --num-cpus=8 --node-ip-address={head} " in text
        assert f"--dashboard-port={base + 1} " in text and f"--node-manager-port={base + 2} " in text
        assert "--block --disable-usage-stats" in text
        assert f" ray start --address={head}:{base} --num-gpus=1 --num-cpus=8 --node-ip-address={worker} " in text
        assert f"--node-manager-port={base + 12} " in text
        # the run, on the head, saw both nodes (Ray advertises a head started at 127.0.0.1 under the host's address)
        (nodes,) = [line.split()[2:] for line in text.splitlines() if line.startswith("probe: nodes")]
        assert worker in nodes and len(set(nodes)) == 2, text[-3000:]
        assert "probe: args trainer.nnodes=2" in text
        # every Ray process of the job ended with it, though linuxproc tracks no daemon that leaves its step
        left = wait_gone(naming(str(ray_tmp)), bound=10)
        assert not left, [proc.cmdline() for proc in left]
    finally:
        for proc in naming(str(ray_tmp)):  # a failed job's Ray, by its own temp dir
            proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
