"""``respo-verl sweep --ray`` sends the cluster's token: where it is found (fast), and a real Ray head with token
auth that answers the sweep's client with the token and refuses it without (slow: ``ray start --head``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import ray_auth
from support.ranks import free_port

from respo_verl.run.reaper import reap
from respo_verl.tools.sweep.runner import ClusterError, auth_headers, connect, ray_token


def test_the_token_is_found_where_ray_looks_for_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    named, default = tmp_path / "named", tmp_path / ".ray" / "auth_token"
    named.write_text("from-the-named-file\n")
    default.parent.mkdir()
    default.write_text("from-the-default-file\n")
    assert ray_token({}) == "from-the-default-file"
    assert ray_token({"RAY_AUTH_TOKEN_PATH": str(named)}) == "from-the-named-file"
    assert ray_token({"RAY_AUTH_TOKEN_PATH": str(named), "RAY_AUTH_TOKEN": "from-env"}) == "from-env"
    assert ray_token({"RAY_AUTH_TOKEN": "from-env", "RAY_AUTH_MODE": "disabled"}) is None
    assert auth_headers({"RAY_AUTH_TOKEN": "t"}) == {"Authorization": "Bearer t"}
    default.unlink()
    assert ray_token({}) is None and auth_headers({}) == {}
    with pytest.raises(ClusterError, match=f"RAY_AUTH_TOKEN_PATH={tmp_path}/none: no such file"):
        ray_token({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")})


@pytest.mark.slow
def test_a_head_with_token_auth_answers_the_sweeps_client_only_with_the_token(tmp_path, monkeypatch):
    temp = tempfile.mkdtemp(prefix="rva-", dir="/tmp")  # Ray's socket paths must stay short
    dashboard = free_port()
    command = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={free_port()}",
        f"--dashboard-port={dashboard}", "--include-dashboard=true", "--num-cpus=1", f"--temp-dir={temp}",
        "--disable-usage-stats",
    ]  # fmt: skip
    try:
        # a session of its own: no terminal, so that the reaper below stops the head's processes
        started = subprocess.run(
            command, env=ray_auth.env(), capture_output=True, text=True, timeout=300, start_new_session=True
        )
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        address = f"http://127.0.0.1:{dashboard}"
        monkeypatch.setenv("RAY_AUTH_TOKEN", ray_auth.env()["RAY_AUTH_TOKEN"])
        assert connect(address).list_jobs() == []
        # A client without the token, then with a wrong one, each in a process of its own: Ray caches the token it
        # loaded once per process (its token loader), so this process would go on sending the session's.
        bare = {
            k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
        }
        bare["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
        assert _connect_elsewhere(address, bare).startswith(
            f"cannot reach the Ray cluster at {address}: the cluster wants a token and no token was found here"
        )
        assert "its token was refused" in _connect_elsewhere(address, {**bare, "RAY_AUTH_TOKEN": "0" * 64})
    finally:
        reap({}, temp)
        shutil.rmtree(temp, ignore_errors=True)


def _connect_elsewhere(address: str, env: dict[str, str]) -> str:
    """The ClusterError line of ``respo_verl.tools.sweep.runner.connect(address)`` in a fresh process with ``env``."""
    program = (
        "import sys\n"
        "from respo_verl.tools.sweep.runner import ClusterError, connect\n"
        "try:\n    connect(sys.argv[1])\nexcept ClusterError as exc:\n    print(exc)\nelse:\n    print('connected')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, address], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()
