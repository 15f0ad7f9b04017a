"""The method-independent starved mass share (``actor/starved_mass_share``) that every policy loss logs in verl's
trainer: verl's registered losses as the plugin leaves them, called as verl's ``ppo_loss`` calls them."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import actor_config
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from respo_verl.core.diagnostics import INDEPENDENT_STARVED_MASS_KEY
from respo_verl.verl import plugin  # noqa: F401  (registers and wraps the losses, as in every verl process)
from respo_verl.verl.starvation import MEASURE, MEASURED_LOSSES


def _call(loss: str, algorithm: str, log_ratio: torch.Tensor, adv_seq: torch.Tensor, mask: torch.Tensor):
    """The registered loss on (B, T) log-ratios against old log-probs of −1, sequence advantages broadcast."""
    config = actor_config("dp", algorithm)
    assert config.policy_loss.loss_mode == loss
    old = torch.full(log_ratio.shape, -1.0, dtype=torch.float64)
    log_prob = (old + log_ratio).requires_grad_(True)
    advantages = adv_seq.to(torch.float64).unsqueeze(-1).expand_as(log_ratio) * mask
    pg_loss, metrics = get_policy_loss_fn(loss)(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
    )
    return pg_loss, metrics, log_prob


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eight sequences of 1-6 tokens; log-ratios spread so that some positives sit below log W = −1."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (8,), generator=gen)
    mask = torch.arange(6) < lengths.unsqueeze(-1)  # (B, T)
    log_ratio = (torch.randn(8, 6, generator=gen, dtype=torch.float64) * 0.6 - 0.2) * mask
    adv_seq = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 0.5, -0.5])
    return log_ratio, adv_seq, mask


@pytest.mark.parametrize("loss", ["respo", "vespo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_it_equals_the_kernel_losses_own_measure(loss, seed):
    log_ratio, adv_seq, mask = _batch(seed)
    _, metrics, _ = _call(loss, loss, log_ratio, adv_seq, mask)
    own = metrics[f"actor/{loss}/starved_mass_share"]
    assert 0.0 < own < 1.0, own  # the batch has starved positives, and other mass
    assert metrics[INDEPENDENT_STARVED_MASS_KEY] == pytest.approx(own, rel=1e-9, abs=1e-12)


def test_vanilla_ppo_clip_matches_a_hand_computed_case():
    """Four sequences of 3 tokens, ε = 0.2 (the grpo preset's clip_ratio):

    - A = +1, every token log-ratio −0.5: log W = −1.5 (starved); r = e^−0.5 is below 1 − ε, which PPO-clip does not
      clip for A > 0, so φ = e^−0.5;
    - A = +1, log-ratio +0.5: r = e^0.5 > 1 + ε is clipped: φ = 0;
    - A = −1 and A = +1 at log-ratio 0: φ = 1.

    Masses φ·|A|·3: the starved share is e^−0.5 / (e^−0.5 + 2).
    """
    config = actor_config("dp", "grpo")
    assert config.clip_ratio_low == config.clip_ratio_high == 0.2
    log_ratio = torch.tensor([[-0.5] * 3, [0.5] * 3, [0.0] * 3, [0.0] * 3], dtype=torch.float64)
    mask = torch.ones(4, 3, dtype=torch.bool)
    pg_loss, metrics, log_prob = _call("vanilla", "grpo", log_ratio, torch.tensor([1.0, 1.0, -1.0, 1.0]), mask)
    expected = math.exp(-0.5) / (math.exp(-0.5) + 2.0)
    assert metrics[INDEPENDENT_STARVED_MASS_KEY] == pytest.approx(expected, rel=1e-9)
    # The wrapped loss's gradient is verl's: the measure took its own gradient without consuming the graph.
    pg_loss.backward()
    assert log_prob.grad[1].abs().sum() == 0 and log_prob.grad[0].abs().sum() > 0


def test_gspo_logs_it_too():
    log_ratio, adv_seq, mask = _batch(0)
    _, metrics, _ = _call("gspo", "gspo", log_ratio, adv_seq, mask)
    assert 0.0 <= metrics[INDEPENDENT_STARVED_MASS_KEY] <= 1.0


def test_no_measure_without_a_gradient_and_the_patch_undoes():
    log_ratio, adv_seq, mask = _batch(0)
    with torch.no_grad():
        _, metrics, _ = _call("vanilla", "grpo", log_ratio, adv_seq, mask)
    assert INDEPENDENT_STARVED_MASS_KEY not in metrics
    wrapped = {name: get_policy_loss_fn(name) for name in MEASURED_LOSSES}
    assert all(hasattr(fn, "unmeasured") for fn in wrapped.values())
    MEASURE.remove()
    try:
        for name, fn in wrapped.items():
            assert get_policy_loss_fn(name) is fn.unmeasured
        _, metrics, _ = _call("vanilla", "grpo", log_ratio, adv_seq, mask)
        assert INDEPENDENT_STARVED_MASS_KEY not in metrics
    finally:
        MEASURE.apply()
    assert get_policy_loss_fn("vanilla") is not wrapped["vanilla"]  # wrapped again, by a new wrapper
    assert hasattr(get_policy_loss_fn("vanilla"), "unmeasured")
