"""scripts/launch/ray_cluster.sh starts Ray with token auth and a dashboard that is not open to the network, with the
node's knobs (address, CPUs checked against GPU slots) and ``ray start`` options passed through.

Real: bash running the script, the token file it makes, its checks. Faked, because starting a real cluster is not
what is tested here (and takes a minute): ``ray`` and ``python3`` on PATH are stand-ins that record their arguments
and the environment Ray would read its auth settings from. The script with the real ``ray``, a head and a worker on
one host, is tested in tests/cpu/test_two_nodes.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts/launch/ray_cluster.sh"
RECORDER = """#!/usr/bin/env bash
echo "$(basename "$0") $* | mode=${RAY_AUTH_MODE:-} path=${RAY_AUTH_TOKEN_PATH:-} token=${RAY_AUTH_TOKEN:-}" >> "$CALLS"
"""


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("ray", "python3"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.log"
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    full = {
        **base,
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "CALLS": str(calls),
        "HOME": str(tmp_path),
        "NUM_CPUS": "64",  # 8 GPU slots (the default) need 24 (verl's 3 per slot); this machine may have 2 cores
    }
    res = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env={**full, **env}, timeout=60)
    return res, calls.read_text().splitlines() if calls.is_file() else []


def _ray_start(calls: list[str]) -> str:
    (line,) = [c for c in calls if c.startswith("ray start")]
    return line


def test_the_head_makes_a_private_token_and_starts_with_auth_on_a_local_dashboard(tmp_path):
    res, calls = _run(tmp_path, "head")
    assert res.returncode == 0, res.stderr
    token = tmp_path / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text().strip()) == 64
    line = _ray_start(calls)
    assert "--dashboard-host=127.0.0.1 " in line and "0.0.0.0" not in line
    assert line.endswith(f"| mode=token path={token} token=")
    assert f"making a Ray token in {token}" in res.stdout

    again, calls = _run(tmp_path, "head")  # a second start keeps the token every node already has
    assert again.returncode == 0 and "making" not in again.stdout and token.read_text() == token.read_text()


def test_the_dashboard_host_is_a_knob(tmp_path):
    res, calls = _run(tmp_path, "head", DASHBOARD_HOST="10.0.0.1")
    assert res.returncode == 0, res.stderr
    assert "--dashboard-host=10.0.0.1 " in _ray_start(calls)


def test_a_worker_needs_the_heads_token_and_uses_it(tmp_path):
    res, calls = _run(tmp_path, "worker", "10.0.0.1")
    assert res.returncode == 2 and not calls
    assert res.stderr.startswith(f"ray_cluster.sh: no Ray token in {tmp_path}/.ray/auth_token: run ")
    shared = tmp_path / "shared-token"
    shared.write_text("f" * 64 + "\n")
    shared.chmod(0o600)
    res, calls = _run(tmp_path, "worker", "10.0.0.1", RAY_AUTH_TOKEN_PATH=str(shared))
    assert res.returncode == 0, res.stderr
    assert _ray_start(calls).endswith(f"--block | mode=token path={shared} token=")


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_a_token_others_can_read_is_refused(tmp_path, mode):
    token = tmp_path / "token"
    token.write_text("f" * 64 + "\n")
    token.chmod(mode)
    res, calls = _run(tmp_path, "head", RAY_AUTH_TOKEN_PATH=str(token))
    assert res.returncode == 2 and not calls
    assert res.stderr.strip() == (
        f"ray_cluster.sh: {token} is readable by others (mode {mode:o}): chmod 600 it, or make a new token"
    )


def test_a_dry_run_makes_no_token(tmp_path):
    res, calls = _run(tmp_path, "head", DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / ".ray").exists() and not calls
    assert "--dashboard-host=127.0.0.1" in res.stdout


def test_the_nodes_address_cpus_and_further_options_reach_ray_start(tmp_path):
    res, calls = _run(tmp_path, "head", "--disable-usage-stats", NUM_GPUS="1", NUM_CPUS="8", NODE_IP="127.0.0.1")
    assert res.returncode == 0, res.stderr
    head = _ray_start(calls).split(" | ")[0]
    assert head.startswith("ray start --head --port=6379 --num-gpus=1 --num-cpus=8 --node-ip-address=127.0.0.1 ")
    assert head.endswith(" --temp-dir=/tmp/ray --disable-usage-stats"), head
    token = tmp_path / ".ray" / "auth_token"
    (tmp_path / "calls.log").unlink()
    options = ("--node-manager-port=6380", "--labels=a b")  # passed on unchanged, spaces included
    res, calls = _run(tmp_path, "worker", "127.0.0.1", *options, NUM_GPUS="1", NUM_CPUS="3", NODE_IP="127.0.0.2")
    assert res.returncode == 0, res.stderr
    assert _ray_start(calls) == (
        "ray start --address=127.0.0.1:6379 --num-gpus=1 --num-cpus=3 --node-ip-address=127.0.0.2 --block "
        f"--node-manager-port=6380 --labels=a b | mode=token path={token} token="
    )
    (tmp_path / "calls.log").unlink()
    res, calls = _run(tmp_path, "head", NUM_GPUS="0", NUM_CPUS="")  # unset: Ray counts the CPUs, no option
    assert res.returncode == 0, res.stderr
    assert "--num-cpus" not in "".join(calls) and "--node-ip-address" not in "".join(calls)


@pytest.mark.parametrize("role", [("head",), ("worker", "10.0.0.1")])
def test_a_node_with_fewer_than_3_cpus_per_gpu_slot_is_refused_in_one_line(tmp_path, role):
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("f" * 64 + "\n")
    token.chmod(0o600)
    res, calls = _run(tmp_path, *role, NUM_GPUS="2", NUM_CPUS="5")
    assert res.returncode == 2 and not calls, res.stderr
    assert res.stderr.strip() == (
        "ray_cluster.sh: NUM_CPUS=5 for NUM_GPUS=2: verl's placement asks 3 logical CPUs per GPU slot and would wait "
        "for ever; set NUM_CPUS to at least 6 (logical CPUs: more than the cores is fine)"
    )
    res, calls = _run(tmp_path, *role, NUM_GPUS="2", NUM_CPUS="6")
    calls = [c for c in calls if "--num-cpus=6" in c]
    assert res.returncode == 0 and "--num-cpus=6" in _ray_start(calls), res.stderr
    res, calls = _run(tmp_path, *role, NUM_GPUS="2", NUM_CPUS="six")
    assert res.returncode == 2 and res.stderr.strip() == "ray_cluster.sh: NUM_CPUS must be a whole number (got 'six')"


def test_node_ports_give_a_node_its_own_six_ports(tmp_path):
    res, calls = _run(tmp_path, "head", NODE_PORTS="30010")
    assert res.returncode == 0, res.stderr
    line = _ray_start(calls)
    ports = ("node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent")
    for offset, name in enumerate((*ports, "metrics-export")):
        assert f" --{name}-port={30010 + offset} " in line, line
    bad, calls = _run(tmp_path, "head", NODE_PORTS="3001x")
    assert bad.returncode == 2 and "NODE_PORTS must be a port number (got '3001x')" in bad.stderr
