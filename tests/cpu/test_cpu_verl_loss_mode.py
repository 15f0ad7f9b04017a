"""verl's own way of choosing a loss, ``actor_rollout_ref.actor.policy_loss.loss_mode=<name>`` without our preset
(``+algorithm=<name>``): the kernel losses train with the paper's defaults and say so once per process.

The first test builds the actor config as verl's entry point builds it (verl's primary config, verl's dataclass
conversion) and calls the registered losses on it, for every kernel loss; the second runs
``python -m verl.trainer.main_ppo ... loss_mode=respo`` on this CPU for two real steps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from conftest import CPU_COMPOSE_OVERRIDES, actor_config, compose
from support.trainer_checks import log_w

from respo_verl.core.config import ReSPOConfig
from respo_verl.core.losses import KERNELS
from respo_verl.cpu.kit.build import KitSpec, build_kit, kit_root
from respo_verl.entry_points import CPU_MODULE

KERNEL_LOSSES = list(KERNELS)
FIX = "actor_rollout_ref.actor.policy_loss._target_=respo_verl.verl.config.ReSPOPolicyLossConfig"


def _batch(seed: int = 0, size: int = 8, length: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(size, length, generator=g) * 2
    log_prob = old + 0.3 * torch.randn(size, length, generator=g)
    mask = torch.arange(length).unsqueeze(0) < torch.randint(1, length + 1, (size, 1), generator=g)
    adv = torch.randn(size, 1, generator=g).expand(size, length) * mask
    return {"old_log_prob": old, "log_prob": log_prob, "advantages": adv, "response_mask": mask}


def _verl_actor_config(loss_mode: str):
    """The actor dataclass of ``python -m verl.trainer.main_ppo ...policy_loss.loss_mode=<loss_mode>``."""
    from verl.utils.config import omega_conf_to_dataclass

    job = compose([f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}", *CPU_COMPOSE_OVERRIDES], entry="verl")
    return omega_conf_to_dataclass(job.actor_rollout_ref.actor)


@pytest.mark.parametrize("name", KERNEL_LOSSES)
def test_verls_loss_mode_key_gives_the_loss_of_our_preset_and_says_so_once(name, capsys, monkeypatch):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import PolicyLossConfig

    from respo_verl.verl import losses

    monkeypatch.setattr(losses, "_ANNOUNCED", set())
    plain, preset = _verl_actor_config(name), actor_config("dp", name)
    assert type(plain.policy_loss) is PolicyLossConfig and plain.policy_loss.loss_mode == name
    fn = get_policy_loss_fn(name)
    for seed in (0, 1):
        data = _batch(seed)
        got = fn(loss_agg_mode="token-mean", config=plain, rollout_is_weights=None, **data)
        expected = fn(loss_agg_mode="token-mean", config=preset, rollout_is_weights=None, **data)
        assert torch.equal(got[0], expected[0]) and got[1] == expected[1]
    err = capsys.readouterr().err
    assert err.count(f"respo-verl: loss_mode={name} with verl's PolicyLossConfig: the kernel uses the paper's") == 1
    assert f"to change them select {FIX} (set by +algorithm={name})" in err
    if name == "respo":
        assert repr(ReSPOConfig()) in err
    # Rollout-IS weights: their level is a key of the kernel block, which verl's config cannot carry.
    data = _batch()
    weights = torch.ones_like(data["old_log_prob"])
    with pytest.raises(TypeError, match=f"loss_mode='{name}' with rollout-IS weights needs {FIX}"):
        fn(loss_agg_mode="token-mean", config=plain, rollout_is_weights=weights, **data)


@pytest.mark.slow
def test_verls_entry_point_trains_respo_chosen_by_verls_key(tmp_path):
    build_kit(KitSpec(), progress=False)
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(log), "RESPO_VERL_CPU_KIT": str(kit_root())}
    env.update(HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled", TORCH_COMPILE_DISABLE="1")
    env["VERL_USE_EXTERNAL_MODULES"] = CPU_MODULE  # verl's entry point: the driver's CPU platform
    ray_tmp = tempfile.mkdtemp(prefix="rv-ray-", dir="/tmp")  # Ray's socket paths must stay short
    command = [
        sys.executable, "-m", "verl.trainer.main_ppo", "+device=cpu",
        "actor_rollout_ref.actor.policy_loss.loss_mode=respo", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.train_batch_size=8", "trainer.total_training_steps=2",
        "trainer.logger=[console,file]", f"+ray_kwargs.ray_init._temp_dir={ray_tmp}",
    ]  # fmt: skip
    try:
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "respo-verl: loss_mode=respo with verl's PolicyLossConfig: the kernel uses the paper's defaults" in out
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert "actor/respo/pos/log_w_mean" in line["data"] and "actor/respo/starved_mass_share" in line["data"]
    # N = 4: updates 2..4 of each rollout batch are off-policy, and the loss sees it in either branch (with N = 2 a
    # step's stale half could hold no positive answer, or follow an update whose advantages were all zero).
    assert max(log_w(lines)) > 0, log_w(lines)
