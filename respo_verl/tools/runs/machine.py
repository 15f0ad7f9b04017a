"""What a measurement depends on besides its seed: the machine it ran on."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, or what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(torch_threads: int) -> dict[str, str]:
    """CPU model, core count, torch version and torch threads (numbers are exact per machine, not across)."""
    import torch

    return {
        "cpu": cpu_name(),
        "cpu_count": str(os.cpu_count()),
        "torch": torch.__version__,
        "torch_threads": str(torch_threads),
    }
