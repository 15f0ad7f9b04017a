"""The GPU stack of docs/gpu.md: its table, the ``gpu`` / ``gpu-megatron`` extras and scripts/install_gpu_env.sh agree;
the extras resolve for Python 3.12 from wheels alone; the two GPU scripts parse and answer their command lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "gpu.md"
INSTALL = ROOT / "scripts" / "install_gpu_env.sh"
CHECK = ROOT / "scripts" / "gpu_check.sh"
GPU_EXTRAS = ("gpu", "gpu-megatron")
# Not the bare extra name: a test whose id is "gpu" carries the keyword that tests/conftest.py skips on CPU.
EXTRA_IDS = [f"respo-verl[{extra}]" for extra in GPU_EXTRAS]
SELF = "respo-verl"
# The packages whose pins the extras carry, by their row in the doc's table.
PINNED_ROWS = {
    "torch": "torch",
    "vllm": "vLLM",
    "transformers": "transformers",
    "verl": "verl",
    "megatron-core": "megatron-core",
    "mbridge": "mbridge",
}
# What the GPU extras must not pull: verl[megatron] drags both in (docs/gpu.md, "The stack").
FORBIDDEN = {"megatron-bridge", "apex"}
# The install script's version variables, by their row in the doc's table.
SCRIPT_ROWS = {
    "PYTHON_VERSION": "Python",
    "TORCH_VERSION": "torch",
    "VLLM_VERSION": "vLLM",
    "VERL_VERSION": "verl",
    "MEGATRON_CORE_VERSION": "megatron-core",
    "MBRIDGE_VERSION": "mbridge",
    "FLASH_ATTN_VERSION": "flash-attn",
    "TRANSFORMER_ENGINE_VERSION": "Transformer Engine",
    "DEEPEP_VERSION": "DeepEP",
}
VERSION = re.compile(r"\d+(?:\.\d+)+")
COMMIT = re.compile(r"commit ([0-9a-f]{7,40})")


def doc_table() -> dict[str, str]:
    """Component -> version cell of the table under "## The stack" (the one whose header is component | version)."""
    rows: dict[str, str] = {}
    lines = DOC.read_text().splitlines()
    start = next(i for i, text in enumerate(lines) if text.startswith("| component | version |"))
    for text in lines[start + 2 :]:
        if not text.startswith("|"):
            break
        cells = [cell.strip() for cell in text.strip("|").split("|")]
        rows[cells[0]] = cells[1]
    return rows


def doc_version(row: str) -> str:
    match = VERSION.search(doc_table()[row])
    assert match, f"docs/gpu.md: no version in the {row!r} row"
    return match.group(0)


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def extra_requirements(extra: str) -> list[Requirement]:
    """The requirements of one extra, with references to this package's other extras expanded."""
    extras = pyproject()["project"]["optional-dependencies"]
    out: list[Requirement] = []
    for text in extras[extra]:
        req = Requirement(text)
        if canonicalize_name(req.name) == SELF:
            for inner in sorted(req.extras):
                out += extra_requirements(inner)
        else:
            out.append(req)
    return out


def exact_pins(reqs: list[Requirement]) -> dict[str, str]:
    pins = {}
    for req in reqs:
        for spec in req.specifier:
            if spec.operator == "==":
                pins[canonicalize_name(req.name)] = spec.version
    return pins


def script_variables() -> dict[str, str]:
    return dict(re.findall(r"^([A-Z_]+)=([^\s#]+)", INSTALL.read_text(), flags=re.MULTILINE))


# -- the pins: doc, pyproject and install script agree ------------------------------------------------------------


@pytest.mark.parametrize("extra", GPU_EXTRAS, ids=EXTRA_IDS)
def test_gpu_extras_pull_neither_megatron_bridge_nor_apex(extra):
    for req in extra_requirements(extra):
        name = canonicalize_name(req.name)
        assert name not in FORBIDDEN, f"[{extra}] lists {req}"
        if name == "verl":
            assert "megatron" not in req.extras, f"[{extra}] lists {req}: it pins megatron-bridge and apex"


@pytest.mark.parametrize("extra", GPU_EXTRAS, ids=EXTRA_IDS)
def test_gpu_extras_pin_the_versions_of_the_doc(extra):
    pins = exact_pins(extra_requirements(extra))
    for package, row in PINNED_ROWS.items():
        if package in ("megatron-core", "mbridge") and extra == "gpu":
            assert package not in pins  # the FSDP path does not need megatron
            continue
        assert pins.get(package) == doc_version(row), f"[{extra}] {package}: {pins.get(package)} vs docs/gpu.md"


def test_every_megatron_core_pin_is_the_doc_version():
    extras = pyproject()["project"]["optional-dependencies"]
    want = doc_version("megatron-core")
    for extra in extras:
        reqs = [r for r in extra_requirements(extra) if canonicalize_name(r.name) == "megatron-core"]
        for req in reqs:
            assert str(req.specifier) == f"=={want}", f"[{extra}] {req}: docs/gpu.md says megatron-core {want}"
    assert f"MEGATRON_CORE_VERSION ?= {want}" in (ROOT / "Makefile").read_text()


def test_install_script_versions_are_the_doc_versions():
    variables = script_variables()
    for variable, row in SCRIPT_ROWS.items():
        assert variables[variable] == doc_version(row), f"{variable}={variables[variable]} vs docs/gpu.md {row}"
    table = doc_table()
    for variable, row in (("APEX_COMMIT", "NVIDIA Apex"), ("DEEPEP_COMMIT", "DeepEP")):
        short = COMMIT.search(table[row])
        assert short and variables[variable].startswith(short.group(1)), f"{variable} vs docs/gpu.md {row}"
    # The CUDA major version the source builds insist on is the doc's CUDA row.
    assert f'"$NVCC_MAJOR" == {doc_version("CUDA").split(".")[0]} ' in INSTALL.read_text()


# -- the scripts' command lines ------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [INSTALL, CHECK], ids=lambda p: p.name)
def test_script_parses(script):
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("script", [INSTALL, CHECK], ids=lambda p: p.name)
def test_script_help(script):
    res = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Usage: scripts/")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "nope"], "unknown backend 'nope' (expected fsdp or megatron)"),
        ([], "--backend is required"),
        (["--backend", "fsdp", "--frobnicate"], "unknown argument '--frobnicate'"),
    ],
)
def test_install_script_refuses_bad_arguments_with_exit_2(args, message):
    res = subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and res.stdout == ""


def test_install_script_refuses_another_python_in_one_line():
    if sys.version_info[:2] == (3, 12):
        pytest.skip("this interpreter is Python 3.12, which the script accepts")
    res = subprocess.run(
        ["bash", str(INSTALL), "--backend", "fsdp", "--python", sys.executable], capture_output=True, text=True
    )
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"install_gpu_env.sh: Python 3.12 is required (the stack of docs/gpu.md), but {sys.executable} is Python "
        f"{sys.version_info[0]}.{sys.version_info[1]}"
    ]


def test_install_script_refuses_the_cpu_venv():
    res = subprocess.run(["bash", str(INSTALL), "--backend", "fsdp", "--venv", ".venv"], capture_output=True, text=True)
    assert res.returncode == 1 and ".venv is the CPU environment of make setup" in res.stderr


def test_gpu_check_refuses_an_unknown_device():
    res = subprocess.run(["bash", str(CHECK), "--device", "tpu"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "unknown device 'tpu'" in res.stderr


@pytest.mark.slow
def test_gpu_check_self_test_on_cpu():
    """scripts/gpu_check.sh --device cpu: every check passes or is skipped with a reason, one line each."""
    env = {**os.environ, "GPU_CHECK_WHEELS": str(ROOT / "no-wheels")}  # the interpreter's own packages only
    res = subprocess.run(
        ["bash", str(CHECK), "--device", "cpu", "--python", sys.executable],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [text for text in res.stdout.splitlines() if not text.startswith("#")]
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    status = {text.split(" ", 2)[1].rstrip(":"): text.split(" ", 1)[0] for text in lines}
    expected = ["kernels", "respo-loss", "vespo-loss", "core-timing", "bench-losses", "megatron-moe"]
    assert list(status) == [*expected, "megatron-moe-deepep"], res.stdout
    assert all(status[name] == "PASS" for name in expected), res.stdout  # verl and megatron-core are installed here


# -- the extras resolve for Python 3.12 ----------------------------------------------------------------------------

INDEX = "https://pypi.org/simple/"
# pip matches each --platform tag exactly, and the CUDA wheels torch 2.11.0 pulls carry different ones
# (nvidia-nccl-cu13: manylinux_2_18, nvidia-cudnn-cu13: manylinux_2_27, megatron-core: manylinux_2_28).
PLATFORMS = ["manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 40))]
# The one dependency PyPI holds only as an sdist: hydra-core 1.3's antlr4-python3-runtime (==4.9.*), pure Python.
# pip builds it without a compiler; here its wheel is built first, since a resolve for another interpreter takes
# wheels only.
PURE_PYTHON_SDISTS = ("antlr4-python3-runtime==4.9.3",)


def _index_reachable() -> str | None:
    """None if PyPI answers, else why not."""
    try:
        with urllib.request.urlopen(urllib.request.Request(INDEX + "pip/", method="HEAD"), timeout=10):
            return None
    except (urllib.error.URLError, OSError) as exc:
        return f"PyPI ({INDEX}) is unreachable: {exc}"


@pytest.mark.slow
def test_gpu_extras_resolve_for_python_3_12(tmp_path):
    """pip resolves the package's dependencies with both GPU extras for CPython 3.12 on x86-64 Linux from wheels
    alone, to the versions of docs/gpu.md's table, with the CUDA runtime of its CUDA row (~1 minute, network)."""
    reason = _index_reachable()
    if reason:
        pytest.skip(reason)
    project = pyproject()["project"]
    reqs = [*project["dependencies"], *(str(r) for r in extra_requirements("gpu-megatron"))]
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), *PURE_PYTHON_SDISTS],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    cmd += ["--find-links", str(wheels)]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
    cmd += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    cmd += ["--target", str(tmp_path / "target"), "--report", str(report), *reqs]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    errors = [text for text in res.stderr.splitlines() if "ERROR" in text]
    assert res.returncode == 0, "\n".join(errors or res.stderr.splitlines()[-20:])
    resolved = {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    for package, row in PINNED_ROWS.items():
        assert resolved.get(package) == doc_version(row), f"{package}: resolved {resolved.get(package)}"
    assert not FORBIDDEN & set(resolved)
    cuda = doc_version("CUDA")
    assert resolved["nvidia-cuda-runtime"].startswith(cuda + "."), (resolved["nvidia-cuda-runtime"], cuda)
