"""verl's own way of choosing a loss, ``actor_rollout_ref.actor.policy_loss.loss_mode=<name>`` without our preset
(``+algorithm=<name>``): the kernel losses train with the paper's defaults and say so once per process.

The test builds the actor config as verl's entry point builds it (verl's primary config, verl's dataclass
conversion) and calls the registered losses on it, for every kernel loss. ``python -m verl.trainer.main_ppo ...
loss_mode=respo`` trains on this CPU in tests/cpu/test_cpu_trainer.py (verl's entry point, trained once in the suite).
"""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_COMPOSE_OVERRIDES, actor_config, compose

from respo_verl.core.config import ReSPOConfig
from respo_verl.core.losses import KERNELS

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
