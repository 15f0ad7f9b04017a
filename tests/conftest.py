"""Shared test set-up: an offline, CPU-only environment and Hydra composition helpers.

Composition goes through Hydra's compose API with the same primary configs as the two entry points:
verl's ``ppo_trainer`` (``python -m verl.trainer.main_ppo``, our presets reached through the search-path plugin as
``+algorithm=...``) and our ``respo_trainer`` (``python -m respo_verl.main_ppo``, ``algorithm=...``).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Ray's token auth, on as on a user's cluster, with a token of this test session (tests/support/ray_auth.py).
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import pytest

from respo_verl.run.compose import CPU_COMPOSE_OVERRIDES as _DATACLASS_OVERRIDES
from respo_verl.run.compose import compose_job

# What verl's validate_config needs on top of the dataclass conversion's keys, without a GPU cluster: the
# log-prob micro-batch sizes of the rollout and the reference model.
CPU_COMPOSE_OVERRIDES = (
    *_DATACLASS_OVERRIDES,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
)


def compose(overrides: list[str] | tuple[str, ...] = (), entry: str = "respo"):
    """Compose the job config of ``entry`` (``respo`` = our main_ppo, ``verl`` = verl's main_ppo)."""
    return compose_job(entry, overrides)


def actor_config(model_engine: str = "dp", algorithm: str = "respo", overrides: tuple[str, ...] = ()):
    """verl's actor dataclass (FSDPActorConfig / McoreActorConfig) built from a composed config, as verl does."""
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose([f"algorithm={algorithm}", f"model_engine={model_engine}", *CPU_COMPOSE_OVERRIDES, *overrides])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


@pytest.fixture(autouse=True)
def _restore_transformer_engine_attention_env():
    """megatron-core sets ``NVTE_*_ATTN`` in ``os.environ`` when it builds a model; keep that inside the test.

    Left set, they reach the trainer subprocesses of later tests, whose local attention backend refuses them.
    """
    from respo_verl.cpu.preset import TE_ATTENTION_ENV

    saved = {name: os.environ.get(name) for name in TE_ATTENTION_ENV}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(params=["dp", "megatron"])
def model_engine(request) -> str:
    return request.param


# Property tests search a fixed sequence of examples, so that CI is reproducible; HYPOTHESIS_PROFILE=explore
# searches afresh with more examples.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, deadline=None)
_hypothesis_settings.register_profile("explore", max_examples=2000, deadline=None)
_hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# --- the order of the files ------------------------------------------------------------------------------------------
# `make test` hands whole files to two workers in collection order (pytest-xdist's loadfile, with
# --no-loadscope-reorder: by default xdist sorts files by their number of tests, which put the heaviest files, with few
# tests each, last, where one worker ran them alone). The heaviest files go first, longest first, so that the other
# worker fills the time with the rest. The weights are seconds per file in a whole suite on the 2-core machine of the
# README (`--durations=0`, summed per file, with other work on the machine: what counts is their order; a new heavy
# file belongs here).
HEAVY_FILES = {
    "tests/cpu/test_cpu_vllm.py": 900,
    "tests/cpu/test_two_nodes.py": 900,
    "tests/cpu/test_cpu_resume.py": 580,
    "tests/cpu/test_demo.py": 350,
    "tests/cpu/test_cpu_megatron_resume.py": 330,
    "tests/cpu/test_cpu_hangs.py": 320,
    "tests/cpu/test_cpu_stops.py": 270,
    "tests/cpu/test_cpu_trainer.py": 180,
    "tests/experiments/mini/test_mini_fork_regime.py": 150,
    "tests/tools/plan/test_planner_build.py": 110,
    "tests/experiments/mini/test_mini_regime.py": 90,
    "tests/experiments/mini/test_mini_grids.py": 70,
}


def _heaviest_first(items) -> None:
    rank = {path: i for i, path in enumerate(sorted(HEAVY_FILES, key=HEAVY_FILES.get, reverse=True))}
    root = Path(__file__).resolve().parents[1]

    def order(item) -> int:
        path = Path(str(item.path)).resolve()
        return rank.get(path.relative_to(root).as_posix() if path.is_relative_to(root) else "", len(rank))

    items.sort(key=order)  # stable: the other files, and the tests of each file, keep their order


def pytest_collection_modifyitems(config, items):
    """The heaviest files first (above); tests marked ``gpu`` skip themselves where no CUDA device is present."""
    import torch

    _heaviest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --- the fast tier ---------------------------------------------------------------------------------------------------
# `make test-fast` (`pytest -m "not slow"`) is the edit loop and must stay a few minutes long: no Ray, no verl run, no
# subprocess that trains. A test outside the slow tier that starts one of them fails at that call, naming the marker.
# What a subprocess's command line (or its ``-c`` code) shows when it trains or starts Ray.
_TRAINING_SIGNS = (
    ("main_ppo", "a trainer entry point (main_ppo)"),
    ("run_ppo(", "verl's trainer (run_ppo)"),
    ("experiments.mini", "the miniature's training"),
    ("ray.init(", "Ray (ray.init)"),
)
_CLI_VERBS = {"demo": "respo-verl demo", "sweep": "respo-verl sweep"}


class SlowTierOnly(AssertionError):
    """A test outside the slow tier started Ray or a trainer."""


def _refusal(test: str, what: str) -> str:
    return (
        f"{test} starts {what}, which the fast tier (`make test-fast`, -m 'not slow') never does: mark the test "
        "@pytest.mark.slow (README, Testing)"
    )


def _training_command(args) -> str | None:
    """What the command line ``args`` starts that the fast tier must not, or None."""
    words = [os.fsdecode(args)] if isinstance(args, (str, bytes, os.PathLike)) else [os.fsdecode(a) for a in args]
    for sign, what in _TRAINING_SIGNS:
        if any(sign in word for word in words):
            return what
    names = [os.path.basename(word) for word in words]
    if "ray" in names and "start" in names:
        return "a Ray cluster (ray start)"
    if "respo_verl.cli" in words or "respo-verl" in names:
        for verb, what in _CLI_VERBS.items():
            if verb in words:
                return what
    return None


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_ray_and_no_trainer(request, monkeypatch):
    """Refuse Ray and trainers at the call, and fail the test afterwards too: code under test may catch the error
    (Hydra's entry point turns any exception into exit status 1)."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    import subprocess

    import ray

    refused: list[str] = []
    request.node.fast_tier_refusals = refused  # read (and cleared) by tests/test_fast_tier.py

    def refuse(what: str):
        refused.append(_refusal(request.node.nodeid, what))
        raise SlowTierOnly(refused[-1])

    popen_init = subprocess.Popen.__init__

    def checked_popen(self, args, *rest, **kwargs):
        what = _training_command(args)
        if what is not None:
            refuse(what)
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: refuse("Ray (ray.init)"))
    yield
    if refused:
        pytest.fail(refused[0], pytrace=False)


# --- the suite's verl drivers -----------------------------------------------------------------------------------------
# Every end-to-end test starts its verl drivers through tests/support/cpu_runs.py, which writes one line per driver to
# the file named by DRIVERS_ENV; the session (the controller, under pytest-xdist) creates it for its workers and
# prints the count at the end (README, Testing: the suite's budget of verl drivers).


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller has set the file
        return
    import tempfile

    from support.cpu_runs import DRIVERS_ENV

    fd, path = tempfile.mkstemp(prefix="rv-drivers-", suffix=".tsv")
    os.close(fd)
    os.environ[DRIVERS_ENV] = path
    config._respo_verl_drivers = path


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    path = getattr(config, "_respo_verl_drivers", None)
    if path is None:
        return
    from collections import Counter
    from pathlib import Path

    lines = [line.split("\t") for line in Path(path).read_text().splitlines() if line.strip()]
    by_file = Counter(test for test, *_ in lines)
    detail = ", ".join(f"{test} {count}" for test, count in sorted(by_file.items()))
    terminalreporter.write_line(f"verl drivers started: {len(lines)}" + (f" ({detail})" if detail else ""))


def pytest_unconfigure(config):
    path = getattr(config, "_respo_verl_drivers", None)
    if path is not None and os.path.exists(path):
        os.unlink(path)
