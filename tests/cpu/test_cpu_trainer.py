"""verl's own trainer on CPU, end to end: ``main_ppo`` with the ``+device=cpu`` preset, as a user runs it.

Each run is a real ``python -m ... main_ppo`` subprocess: Ray, TransferQueue, the agent loop, the hf_cpu rollout
server, FSDP2 on gloo, verl's naive weight sync and verl's file logger. Nothing is mocked; one run injects a fault
(NaN log-probabilities reaching the registered loss) through a module loaded in the Ray workers.

The runs share one tiny-model kit (built once, cached). They take a few minutes together on a 2-core machine. ReSPO
through our entry point with rollout reuse is checked on the uninterrupted reference run of ``test_cpu_resume.py``
(the same command, shared with the resume tests).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.trainer_checks import ON_POLICY_LOG_W, assert_trains, assert_weights_synced, log_w

from respo_verl.cpu.kit.build import KitSpec, build_kit, kit_root
from respo_verl.entry_points import CPU_MODULE, PLUGIN_MODULE
from respo_verl.run.stops import EXIT_GUARD

pytestmark = pytest.mark.slow

CPU_MODULES = Path(__file__).resolve().parents[1] / "support" / "cpu_modules"


@pytest.fixture(scope="module")
def kit():
    return build_kit(KitSpec(), progress=False)


def _job(algorithm: str, reuse: int, steps: int, mini_batch: int = 2) -> list[str]:
    return [
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        f"data.train_batch_size={reuse * mini_batch}",
        f"trainer.total_training_steps={steps}",
        "trainer.experiment_name=test",
    ]


def run_main_ppo(tmp_path: Path, entry: str, overrides: list[str], timeout: int = 600):
    """Run ``python -m <entry> <overrides>`` with the file logger at ``tmp_path/log.jsonl``; (process, log lines)."""
    log = tmp_path / "log.jsonl"
    env = {
        **os.environ,
        "VERL_FILE_LOGGER_PATH": str(log),
        "RESPO_VERL_CPU_KIT": str(kit_root()),
        "HF_HUB_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
        "TORCH_COMPILE_DISABLE": "1",
    }
    if entry == "verl.trainer.main_ppo":
        # verl's own entry point: the driver switches to verl on CPU through verl's external-module seam.
        env["VERL_USE_EXTERNAL_MODULES"] = CPU_MODULE
    # Ray's socket paths must stay under 107 bytes: a short private temp dir, not pytest's deep tmp_path.
    ray_tmp = tempfile.mkdtemp(prefix="rv-ray-", dir="/tmp")
    cmd = [sys.executable, "-m", entry, *overrides, f"+ray_kwargs.ray_init._temp_dir={ray_tmp}"]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    return proc, lines


def _tail(proc) -> str:
    return (proc.stdout + proc.stderr)[-4000:]


def test_vespo_with_verls_entry_point_and_legacy_trainer(kit, tmp_path):
    steps = 2
    overrides = ["+algorithm=vespo", "+device=cpu", "trainer.use_v1=false", *_job("vespo", 4, steps)]
    proc, lines = run_main_ppo(tmp_path, "verl.trainer.main_ppo", overrides)
    assert proc.returncode == 0, _tail(proc)
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    for line in lines:
        assert any(k.startswith("actor/vespo/") for k in line["data"]), sorted(line["data"])
    assert_trains(lines)


def _extra_modules(module: str) -> list[str]:
    """Overrides that make every Ray process import the test-only ``module`` of tests/support/cpu_modules too."""
    modules = f"{PLUGIN_MODULE},{CPU_MODULE},{module}"
    return [
        f"ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='{modules}'",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH={CPU_MODULES}",
    ]


def test_negative_controls_stale_server_weights_and_on_policy_log_w(kit, tmp_path):
    """N = 1 with a server that ignores weight updates: log W stays 0, and the weight-sync assertion fails."""
    overrides = [
        "algorithm=respo",
        "+device=cpu",
        *_job("respo", 1, 3),
        "actor_rollout_ref.actor.optim.lr=1e-2",
        *_extra_modules("frozen_rollout"),
    ]
    proc, lines = run_main_ppo(tmp_path, "respo_verl.main_ppo", overrides)
    assert proc.returncode == 0, _tail(proc)
    assert len(lines) == 3
    assert max(log_w(lines)) < ON_POLICY_LOG_W, log_w(lines)
    with pytest.raises(AssertionError, match="rollout/actor log-prob gap"):
        assert_weights_synced(lines)


def test_nonfinite_log_probs_stop_the_run_with_the_loss_error(kit, tmp_path):
    overrides = ["algorithm=respo", "+device=cpu", *_job("respo", 2, 2), *_extra_modules("inject_nonfinite")]
    proc, lines = run_main_ppo(tmp_path, "respo_verl.main_ppo", overrides)
    assert proc.returncode == EXIT_GUARD, _tail(proc)
    # one line naming the step and the loss's refusal, and no traceback after it
    stop = [line for line in proc.stderr.splitlines() if line.startswith("respo_verl.main_ppo: stopped ")]
    assert len(stop) == 1 and stop[0].startswith(
        "respo_verl.main_ppo: stopped (non-finite data, exit 3): step 1: FloatingPointError: respo loss received "
        "non-finite values on valid response tokens"
    ), _tail(proc)
    assert "Traceback" not in proc.stderr[proc.stderr.index(stop[0]) :], _tail(proc)
    assert lines == []  # no step was logged: the run did not train on
