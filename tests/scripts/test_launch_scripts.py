"""The example launch scripts: knob validation, and a dry run that checks the layout and composes the job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from respo_verl.run import resolvers

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(ROOT / script)], capture_output=True, text=True, env=full, timeout=timeout)


@pytest.mark.parametrize("env, message", [({"ALGO": "ppo"}, "ALGO must be"), ({"N": "7"}, "N must divide 1024")])
def test_bad_knobs_stop_before_anything_runs(env, message):
    res = _run("examples/run_qwen3_1p7b_fsdp.sh", **env)
    assert res.returncode == 2 and message in res.stderr


def _plain_shell_env(**env) -> dict[str, str]:
    """The environment of a shell where the virtual environment is neither active nor on PATH."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    return {**base, "PATH": path, **env}


def _job(res: subprocess.CompletedProcess):
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    _, _, job_yaml = ("\n" + res.stdout).partition("\ncommand:\n")
    return OmegaConf.create(job_yaml.split("\n", 1)[1])  # the line after "command:" is the command itself


@pytest.mark.slow
def test_routing_knob_composes_the_job_from_a_plain_shell():
    """ROUTING=r2 reaches the composed job; no PYTHON and no venv on PATH: the script finds the checkout's .venv.
    Without EXPERIMENT the preset names the run (respo_verl.run.resolvers.run_name), and CKPT_DIR holds its folder."""
    script = ROOT / "examples/run_qwen3_30b_a3b_megatron.sh"
    env = _plain_shell_env(PLAN="0", DRY_RUN="1", ROUTING="r2", CKPT_DIR="/ckpt", MODEL_PATH="/m/Qwen3-30B-A3B-Base")
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=300)
    job = _job(res)
    resolvers.register()  # --cfg job prints the job unresolved
    assert job.actor_rollout_ref.actor.megatron.router_replay.mode == "R2"
    assert job.trainer.experiment_name == "Qwen3-30B-A3B-Base-respo-n8-s1-r2"
    assert job.trainer.default_local_dir == "/ckpt/Qwen3-30B-A3B-Base-respo-n8-s1-r2"


@pytest.mark.slow
def test_experiment_replaces_the_presets_run_name():
    res = _run("examples/run_qwen3_1p7b_fsdp.sh", PLAN="0", DRY_RUN="1", EXPERIMENT="mine", CKPT_DIR="/ckpt")
    job = _job(res)
    resolvers.register()
    assert (job.trainer.experiment_name, job.trainer.default_local_dir) == ("mine", "/ckpt/mine")


def test_an_interpreter_without_respo_verl_is_named_with_what_to_do():
    res = _run("examples/run_qwen3_1p7b_fsdp.sh", PYTHON="false")
    assert res.returncode == 2
    assert res.stderr.startswith("PYTHON=false cannot import respo_verl: run 'make setup' in")


def test_bad_routing_knob_stops_before_anything_runs():
    res = _run("examples/run_qwen3_30b_a3b_megatron.sh", ROUTING="r4")
    assert res.returncode == 2 and "ROUTING must be off, r2 or r3" in res.stderr


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
    job = _job(res)
    assert "OK: every rule holds" in res.stdout  # the planner ran first
    n = int(env["N"])
    assert job.actor_rollout_ref.actor.strategy == strategy
    assert job.actor_rollout_ref.actor.policy_loss.loss_mode == loss_mode
    assert job.data.train_batch_size == 32 * n
    assert job.actor_rollout_ref.actor.ppo_mini_batch_size == 32
    assert job.trainer.total_training_steps == 1024 // n
    assert job.reward.reward_manager.name == "dapo"


def _cuda_python() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda_python(), reason="this interpreter's torch has CUDA")
@pytest.mark.parametrize("script", ["examples/run_qwen3_1p7b_fsdp.sh", "examples/run_qwen3_30b_a3b_megatron.sh"])
def test_a_cuda_job_from_an_interpreter_without_cuda_is_refused_naming_it(script):
    res = _run(script, PLAN="0")
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"PYTHON={sys.executable} ({sys.executable} Python ")
    assert "has no CUDA" in line and "trainer.device=cuda" in line and ".venv-gpu" in line
    assert "command:" not in res.stdout  # refused before the command is built into a run


def _checkout_copy(root: Path, venvs: tuple[str, ...]) -> Path:
    """The example's scripts in a checkout of their own whose virtual environments run this interpreter."""
    for rel in ("examples/run_qwen3_1p7b_fsdp.sh", "scripts/launch/launch_common.sh"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text((ROOT / rel).read_text())
    for venv in venvs:
        python = root / venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        python.chmod(0o755)
    return root / "examples/run_qwen3_1p7b_fsdp.sh"


@pytest.mark.skipif(_cuda_python(), reason="this interpreter's torch has CUDA")
def test_the_gpu_environment_is_preferred_to_the_cpu_one(tmp_path):
    script = _checkout_copy(tmp_path, (".venv", ".venv-gpu"))
    env = _plain_shell_env(PLAN="0")
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 2
    assert res.stderr.startswith(f"PYTHON={tmp_path}/.venv-gpu/bin/python ({sys.executable} Python ")


def test_a_dry_run_or_a_cpu_job_needs_no_cuda(tmp_path):
    # A dry run only composes; the CPU presets set trainer.device=cpu. Both get past the check to the planner
    # (PLAN=1), which refuses the bad override that stops the run here.
    for env in ({"DRY_RUN": "1"}, {}):
        extra = [] if env else ["+device=cpu"]
        res = subprocess.run(
            ["bash", str(ROOT / "examples/run_qwen3_1p7b_fsdp.sh"), *extra, "trainer.nnodes=abc"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHON": sys.executable, **env},
            timeout=300,
        )
        assert res.returncode == 2 and "has no CUDA" not in res.stderr, res.stderr
        assert "respo-verl plan refused its input" in res.stderr
