"""verl's own trainer on CPU, end to end: ``main_ppo`` with the ``+device=cpu`` preset, as a user runs it.

Each run is a real ``python -m ... main_ppo`` subprocess: Ray, TransferQueue, the agent loop, the hf_cpu rollout
server, FSDP2 on gloo, verl's naive weight sync and verl's file logger. Nothing is mocked; one run injects a fault
(NaN log-probabilities reaching the registered loss) through a module loaded in the Ray workers.

The runs share one tiny-model kit (built once, cached). They take a few minutes together on a 2-core machine.
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

from respo_verl.cpu.kit.build import KitSpec, build_kit, kit_root
from respo_verl.entry_points import CPU_MODULE, PLUGIN_MODULE

pytestmark = pytest.mark.slow

CPU_MODULES = Path(__file__).resolve().parents[1] / "support" / "cpu_modules"
RESPO_KEYS = (
    "actor/respo/pos/frac",
    "actor/respo/pos/log_w_mean",
    "actor/respo/pos/phi_mean",
    "actor/respo/neg/frac",
    "actor/respo/neg/log_w_mean",
    "actor/respo/neg/phi_mean",
    "actor/respo/clamp_frac",
    "actor/respo/starved_frac",
    "actor/respo/starved_mass_share",
)
# The rollout and the actor compute log-probs of the same tokens with the same fp32 weights when weights are synced
# (measured ~1e-6); a server that kept stale weights differs by >= 1e-3 after one update at lr 1e-2.
SYNCED_LOG_PROB_GAP = 1e-4
# Rollout reuse: the 2nd..N-th mini-batches are off-policy, so |mean log W| of a branch is away from 0 (0.03-0.16 per
# step measured with the preset's lr 1e-4, N = 4); on-policy (N = 1) it is float noise (~1e-5).
STALE_LOG_W = 1e-2
ON_POLICY_LOG_W = 1e-4


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


def assert_weights_synced(lines: list[dict]) -> None:
    gaps = [line["data"]["training/rollout_probs_diff_max"] for line in lines]
    assert max(gaps) < SYNCED_LOG_PROB_GAP, f"rollout/actor log-prob gap per step: {gaps}"


def assert_trains(lines: list[dict]) -> None:
    """Every step with a non-zero advantage has a non-zero gradient, and some step has one.

    A step whose prompts all got one reward (e.g. every answer wrong) has advantages 0 everywhere, and then the
    gradient is exactly 0: that is right, not a failure. The rollout server's sampling is not reproducible from run to
    run (it depends on how the agent loop interleaves requests), so such a step can occur in any run.
    """
    learning = []
    for line in lines:
        data = line["data"]
        flat = data["critic/advantages/max"] == 0.0 and data["critic/advantages/min"] == 0.0
        if flat:
            assert data["actor/grad_norm"] == 0.0, (
                f"step {line['step']}: zero advantages, grad norm {data['actor/grad_norm']}"
            )
        else:
            assert data["actor/grad_norm"] > 0, f"step {line['step']}: non-zero advantages but no gradient"
            learning.append(line["step"])
        assert data["actor/loss"] == data["actor/loss"]  # finite, not NaN
    assert learning, "no step had a non-zero advantage: the run never trained"


def _log_w(lines: list[dict]) -> list[float]:
    return [abs(line["data"][f"actor/respo/{b}/log_w_mean"]) for line in lines for b in ("pos", "neg")]


def test_respo_with_our_entry_point_trains_with_rollout_reuse(kit, tmp_path):
    steps = 3
    proc, lines = run_main_ppo(
        tmp_path, "respo_verl.main_ppo", ["algorithm=respo", "+device=cpu", *_job("respo", 4, steps)]
    )
    assert proc.returncode == 0, _tail(proc)
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    for line in lines:
        missing = [k for k in RESPO_KEYS if k not in line["data"]]
        assert not missing, f"step {line['step']} lacks {missing}"
    assert_trains(lines)
    assert_weights_synced(lines)
    # N = 4: mini-batches 2..4 of every rollout batch are off-policy, and ReSPO's metrics see it.
    assert max(_log_w(lines)) > STALE_LOG_W, _log_w(lines)


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
    assert max(_log_w(lines)) < ON_POLICY_LOG_W, _log_w(lines)
    with pytest.raises(AssertionError, match="rollout/actor log-prob gap"):
        assert_weights_synced(lines)


def test_nonfinite_log_probs_stop_the_run_with_the_loss_error(kit, tmp_path):
    overrides = ["algorithm=respo", "+device=cpu", *_job("respo", 2, 2), *_extra_modules("inject_nonfinite")]
    proc, lines = run_main_ppo(tmp_path, "respo_verl.main_ppo", overrides)
    assert proc.returncode != 0
    assert "FloatingPointError" in proc.stdout + proc.stderr, _tail(proc)
    assert "non-finite" in proc.stdout + proc.stderr, _tail(proc)
    assert lines == []  # no step was logged: the run did not train on
