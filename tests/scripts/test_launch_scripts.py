"""The example launch scripts: knob validation, and a dry run that checks the layout and composes the job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(ROOT / script)], capture_output=True, text=True, env=full, timeout=timeout)


@pytest.mark.parametrize("env, message", [({"ALGO": "ppo"}, "ALGO must be"), ({"N": "7"}, "N must divide 1024")])
def test_bad_knobs_stop_before_anything_runs(env, message):
    res = _run("examples/run_qwen3_1p7b_fsdp.sh", **env)
    assert res.returncode == 2 and message in res.stderr


def test_routing_knob_is_passed_only_when_set():
    # PYTHON=echo prints the command instead of running it; PLAN=0 skips the layout check.
    plain = _run("examples/run_qwen3_30b_a3b_megatron.sh", PYTHON="echo", PLAN="0", DRY_RUN="1")
    routed = _run("examples/run_qwen3_30b_a3b_megatron.sh", PYTHON="echo", PLAN="0", DRY_RUN="1", ROUTING="r3")
    assert "+routing=" not in plain.stdout
    assert "+routing=r3" in routed.stdout and "_r3" in routed.stdout  # and the experiment name says so


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, env, strategy, loss_mode",
    [
        ("examples/run_qwen3_30b_a3b_megatron.sh", {"ALGO": "respo", "N": "16", "SEED": "3"}, "megatron", "respo"),
        ("examples/run_qwen3_1p7b_fsdp.sh", {"ALGO": "gspo", "N": "32"}, "fsdp", "gspo"),
    ],
)
def test_dry_run_plans_and_composes_the_job(script, env, strategy, loss_mode):
    res = _run(script, DRY_RUN="1", **env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "OK: every rule holds" in res.stdout  # the planner ran first
    _, _, job_yaml = res.stdout.partition("\ncommand:\n")
    job = OmegaConf.create(job_yaml.split("\n", 1)[1])  # the line after "command:" is the command itself
    n = int(env["N"])
    assert job.actor_rollout_ref.actor.strategy == strategy
    assert job.actor_rollout_ref.actor.policy_loss.loss_mode == loss_mode
    assert job.data.train_batch_size == 32 * n
    assert job.actor_rollout_ref.actor.ppo_mini_batch_size == 32
    assert job.trainer.total_training_steps == 1024 // n
    assert job.reward.reward_manager.name == "dapo"
