"""verl's own CPU tests (shipped in the wheel as a top-level ``tests`` package) still pass with this package installed.

``import verl`` loads our ``verl.plugins`` entry point in every process, so our registrations are present while verl's
trainer tests run (the registries, the policy-loss and advantage dispatch they exercise).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import verl

# Passing on the verl 0.9.1 wheel without this package; about 15 s on a 2-core box.
VERL_CPU_TESTS_PASSING = 123
SUITE_TIMEOUT_S = 600


def _verl_tests_dir() -> Path:
    site_packages = Path(verl.__file__).resolve().parent.parent
    tests_dir = site_packages / "tests" / "trainer"
    if not tests_dir.is_dir():
        pytest.fail(f"verl's shipped tests are missing: {tests_dir} (is verl installed from the 0.9.x wheel?)")
    return tests_dir


@pytest.mark.slow
def test_verls_trainer_cpu_tests_pass_with_the_plugin_installed(tmp_path):
    assert any(ep.value == "respo_verl.verl.plugin" for ep in entry_points(group="verl.plugins"))
    tests_dir = _verl_tests_dir()
    # An empty ini file and rootdir keep this repository's pytest settings (found as an ancestor of site-packages
    # inside .venv) away from verl's suite.
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.update(HF_HUB_OFFLINE="1", TORCH_COMPILE_DISABLE="1")
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(ini),
        "--rootdir",
        str(tmp_path),
        "-p",
        "no:cacheprovider",
        "-o",
        "python_files=*_on_cpu.py",
        "-q",
        str(tests_dir),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S)
    output = f"{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"verl's CPU tests failed (rc={proc.returncode}):\n{output}"
    # The final line of pytest's report: "123 passed, 11 warnings in 6.80s".
    summaries = [line for line in proc.stdout.splitlines() if re.search(r"\d+ passed.* in [\d.]+s", line)]
    assert summaries, output
    summary = summaries[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|errors?)", summary)}
    assert counts.get("passed", 0) >= VERL_CPU_TESTS_PASSING, summary
    assert counts.get("failed", 0) == 0 and counts.get("error", 0) == 0 and counts.get("errors", 0) == 0, summary
