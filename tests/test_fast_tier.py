"""The fast tier's guard (tests/conftest.py): a test without the slow marker that starts Ray or a trainer fails."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import SlowTierOnly, _training_command


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        ([sys.executable, "-m", "respo_verl.main_ppo", "algorithm=respo"], "main_ppo"),
        ([sys.executable, "-m", "verl.trainer.main_ppo", "--cfg", "job"], "main_ppo"),
        ([sys.executable, "-c", "import ray; ray.init(num_cpus=1)"], "ray.init"),
        (["ray", "start", "--head"], "ray start"),
        ([sys.executable, "-m", "experiments.mini", "--quick"], "miniature"),
        ([sys.executable, "-m", "respo_verl.cli", "demo", "--steps", "2"], "demo"),
        (["/x/.venv/bin/respo-verl", "sweep", "--grid", "g"], "sweep"),
        ("python -m respo_verl.main_ppo algorithm=respo", "main_ppo"),
    ],
)
def test_commands_that_train_or_start_ray_are_named(argv, what):
    assert what in _training_command(argv)


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "respo_verl.cli", "plan", "qwen3_30b_a3b_h100_2x8"],
        [sys.executable, "-m", "respo_verl.cli", "report", "runs/"],
        ["git", "check-ignore", "x"],
        ["bash", "scripts/launch/slurm/respo.sbatch"],
    ],
)
def test_other_commands_pass(argv):
    assert _training_command(argv) is None


def test_a_fast_test_that_starts_ray_or_a_trainer_is_stopped_and_failed(request):
    import ray

    with pytest.raises(SlowTierOnly, match=r"starts Ray \(ray.init\).*mark the test @pytest.mark.slow"):
        ray.init(num_cpus=1)
    with pytest.raises(SlowTierOnly, match=r"starts a trainer entry point \(main_ppo\)"):
        subprocess.run([sys.executable, "-m", "respo_verl.main_ppo", "algorithm=respo"], capture_output=True)
    refused = request.node.fast_tier_refusals
    assert len(refused) == 2  # the guard fails the test at its end even if the code under test caught the error
    refused.clear()


def _guarded() -> tuple[bool, bool]:
    """Whether subprocess.Popen and ray.init are the guard's stand-ins in this test."""
    import ray

    return "checked_popen" in subprocess.Popen.__init__.__qualname__, ray.init.__module__ == "conftest"


def test_a_fast_test_is_guarded():
    assert _guarded() == (True, True)


@pytest.mark.slow
def test_the_slow_tier_is_not_guarded():
    assert _guarded() == (False, False)  # subprocess's and Ray's own functions
