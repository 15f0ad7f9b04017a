"""Ray's token auth in the tests: every Ray cluster a test starts, and every client of one, uses the token of the
test session.

Ray (2.52 and later) turns token auth on with ``RAY_AUTH_MODE=token`` and reads the token from ``RAY_AUTH_TOKEN``
first; a token in the environment leaves the user's ``~/.ray/auth_token`` alone. tests/conftest.py sets both once
per session, so that the trainer subprocesses, ``ray start --head`` and ``respo-verl sweep --ray`` (which sends the
token through Ray's own client, ``respo_verl.tools.sweep.runner.connect``) share them. A test that starts a head passes
:func:`env` to it and to its clients; a client in the test process sends :func:`headers`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

MODE, TOKEN = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"
TOKEN_BYTES = 32  # 256 bits, as Ray's own generated tokens


def env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with token auth on and the session's token."""
    os.environ.setdefault(TOKEN, secrets.token_hex(TOKEN_BYTES))
    return {**(os.environ if base is None else base), MODE: "token", TOKEN: os.environ[TOKEN]}


def headers() -> dict[str, str]:
    """The header a client in the test process sends to a test cluster's dashboard (Ray's bearer token)."""
    return {"Authorization": f"Bearer {env()[TOKEN]}"}
