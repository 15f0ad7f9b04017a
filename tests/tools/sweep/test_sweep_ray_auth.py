"""``respo-verl sweep --ray`` sends the cluster's token through Ray's own client: a token file that is not there is
one line (fast), and a real Ray head with token auth answers the sweep's client with the token, from the environment
or a file, and refuses it without (slow: ``ray start --head``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support import ray_auth
from support.ray_head import ray_head

from respo_verl.tools.sweep.runner import connect


def test_a_token_file_that_is_not_there_is_refused_in_one_line(tmp_path):
    with socket.socket() as listener:  # something listens at the address: the reachability probe passes
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"http://127.0.0.1:{listener.getsockname()[1]}"
        env = {**_bare(tmp_path), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")}
        assert _connect_elsewhere(address, env) == f"RAY_AUTH_TOKEN_PATH={tmp_path}/none: no such file, or it is empty"


@pytest.mark.slow
def test_a_head_with_token_auth_answers_the_sweeps_client_only_with_the_token(tmp_path, monkeypatch):
    with ray_head(ray_auth.env(), num_cpus=1, num_gpus=0) as address:
        monkeypatch.setenv("RAY_AUTH_TOKEN", ray_auth.env()["RAY_AUTH_TOKEN"])
        assert connect(address).list_jobs() == []
        # A client without the token, then with a wrong one, each in a process of its own: Ray caches the token it
        # loaded once per process (its token loader), so this process would go on sending the session's.
        bare = _bare(tmp_path)
        assert _connect_elsewhere(address, bare).startswith(
            f"cannot reach the Ray cluster at {address}: the cluster wants a token and no token was found here"
        )
        token_on = {**bare, "RAY_AUTH_MODE": "token"}
        assert "its token was refused" in _connect_elsewhere(address, {**token_on, "RAY_AUTH_TOKEN": "0" * 64})
        named = tmp_path / "cluster_token"  # the token where Ray looks for it: the file RAY_AUTH_TOKEN_PATH names
        named.write_text(ray_auth.env()["RAY_AUTH_TOKEN"])
        named.chmod(0o600)
        assert _connect_elsewhere(address, {**token_on, "RAY_AUTH_TOKEN_PATH": str(named)}) == "connected"


def _bare(home: Path) -> dict[str, str]:
    """This environment without Ray's token auth, and a home without ``~/.ray/auth_token``."""
    drop = ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "HOME": str(home)}


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
