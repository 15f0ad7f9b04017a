"""GPU checks (skipped without CUDA): the losses run on the device with exactly one host synchronisation."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import actor_config
from verl.trainer.ppo.core_algos import get_policy_loss_fn


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["respo", "vespo"])
def test_one_device_synchronisation_per_call_on_cuda(name):
    cfg = actor_config("megatron", name)
    g = torch.Generator(device="cuda").manual_seed(0)
    old = -torch.rand(16, 256, device="cuda", generator=g)
    log_prob = (old + 0.1 * torch.randn(16, 256, device="cuda", generator=g)).requires_grad_(True)
    mask = torch.ones(16, 256, dtype=torch.bool, device="cuda")
    adv = torch.randn(16, 1, device="cuda", generator=g).expand(16, 256).contiguous()
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=16 * 256, global_batch_size=16, loss_scale_factor=None)
    fn = get_policy_loss_fn(name)
    kwargs = dict(old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, loss_agg_mode="token-mean")
    try:
        fn(**kwargs, config=cfg)  # warm-up: lazy CUDA initialisation may synchronise
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, _ = fn(**kwargs, config=cfg)
        torch.cuda.set_sync_debug_mode("default")
    finally:
        cfg.global_batch_info.clear()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert loss.is_cuda and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(log_prob.grad).all()
