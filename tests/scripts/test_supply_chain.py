"""What the install scripts fetch and what git keeps out (issue 55, item 6).

flash-attn's build is checked on the install script's text: running it needs nvcc and a CUDA torch, which this
machine does not have (docs/gpu.md runs it on a GPU node).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands(script: Path) -> list[str]:
    """The script's command lines, continuation lines joined."""
    return [line.strip() for line in re.sub(r"\\\n\s*", " ", script.read_text()).splitlines()]


def test_flash_attn_is_built_from_its_sdist_never_downloaded_as_a_wheel():
    installs = [c for c in _commands(ROOT / "scripts/install_gpu_env.sh") if "install" in c and "flash-attn==" in c]
    assert len(installs) == 1, installs
    (command,) = installs
    # setup.py downloads a prebuilt wheel from GitHub unless forced to build; pip takes a wheel from the index
    # unless told not to
    assert command.startswith("FLASH_ATTENTION_FORCE_BUILD=TRUE "), command
    assert "--no-binary flash-attn" in command, command


def test_the_gpu_environment_is_ignored_by_git():
    for path in (".venv-gpu/bin/python", ".venv-gpu/lib/python3.12/site-packages/torch/__init__.py"):
        found = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert found.returncode == 0, f"{path} is not ignored"
