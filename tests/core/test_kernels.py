"""Kernel values, limits and slopes against docs/method.md §4 (hand-derived expectations, fp64)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from respo_verl.core.config import KernelBranch, ReSPOConfig, VESPOConfig
from respo_verl.core.kernels import (
    HybridConfig,
    phi_one,
    respo_log_phi,
    respo_neg_phi,
    respo_phi,
    respo_pos_phi,
    sequence_log_weight,
    vespo_log_phi,
    vespo_phi,
)
from respo_verl.core.losses import kernel_terms

DEFAULTS = ReSPOConfig()
W_GRID = (1e-8, 0.01, 0.1, 0.25, 0.5, 1.0, 2.0, 10.0, 100.0)
# The reference table of docs/method.md §4.3: (value, absolute tolerance implied by the digits printed there).
PHI_POS_REF = ((1.359141, 5e-7), (1.359073, 5e-7), (1.352782, 5e-7), (1.323125, 5e-7), (1.236541, 5e-7),
               (1.0, 1e-12), (0.551819, 5e-7), (6.79e-4, 5e-7), (5e-42, 0.5e-42))  # fmt: skip
PHI_NEG_REF = ((7.39e-4, 5e-7), (0.604965, 5e-7), (1.241415, 5e-7), (1.359141, 5e-7), (1.270249, 5e-7),
               (1.0, 1e-12), (0.617638, 5e-7), (0.041867, 5e-7), (1.5e-7, 0.05e-7))  # fmt: skip

branches = st.builds(
    KernelBranch,
    alpha=st.floats(1.0, 4.0),
    beta=st.floats(0.01, 1.0),
    lam=st.floats(0.0, 4.0),
)


def phi(w: float | torch.Tensor, branch: KernelBranch) -> torch.Tensor:
    return respo_log_phi(torch.as_tensor(w, dtype=torch.float64).log(), branch).exp()


@pytest.mark.parametrize("branch, table", [(DEFAULTS.positive, PHI_POS_REF), (DEFAULTS.negative, PHI_NEG_REF)])
def test_reference_values(branch, table):
    got = phi(torch.tensor(W_GRID, dtype=torch.float64), branch)
    for w, value, (expected, tol) in zip(W_GRID, got.tolist(), table):
        assert abs(value - expected) <= tol, f"phi({w}) = {value!r}, docs/method.md §4.3 gives {expected}"


def test_default_branches_match_closed_forms():
    w = torch.logspace(-12, 3, 400, dtype=torch.float64)
    closed_pos = (1 + w) / 2 * torch.exp(1 - w)
    closed_neg = w.sqrt() * torch.exp(2 * (1 - w.sqrt()))
    torch.testing.assert_close(phi(w, DEFAULTS.positive), closed_pos, rtol=1e-12, atol=1e-300)
    torch.testing.assert_close(phi(w, DEFAULTS.negative), closed_neg, rtol=1e-12, atol=1e-300)


@settings(max_examples=200, deadline=None)
@given(branches)
def test_on_policy_weight_is_one_and_slope_is_beta_one_minus_lambda(branch):
    assert phi(1.0, branch).item() == pytest.approx(1.0, abs=1e-12)
    h = 1e-5
    slope = (phi(1.0 + h, branch) - phi(1.0 - h, branch)).item() / (2 * h)
    assert slope == pytest.approx(branch.beta * (1 - branch.lam), abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(alpha=st.floats(1.5, 4.0), beta=st.floats(0.01, 0.99), lam=st.floats(0.0, 4.0))
def test_power_mean_branch_keeps_a_floor_for_vanishing_weights(alpha, beta, lam):
    branch = KernelBranch(alpha, beta, lam)
    c = (1 - beta) ** (1 / (alpha - 1))
    floor = c * math.exp(lam * (1 - c))
    assert phi(math.exp(-400.0), branch).item() == pytest.approx(floor, rel=1e-9)


def test_default_positive_floor_is_e_over_two():
    assert phi(1e-30, DEFAULTS.positive).item() == pytest.approx(math.e / 2, rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(beta=st.floats(0.05, 1.0), lam=st.floats(0.0, 4.0))
def test_geometric_branch_closed_form(beta, lam):
    w = torch.logspace(-8, 8, 200, dtype=torch.float64)
    expected = w**beta * torch.exp(lam * (1 - w**beta))
    torch.testing.assert_close(phi(w, KernelBranch(1.0, beta, lam)), expected, rtol=1e-10, atol=1e-300)


def test_default_negative_branch_vanishes_at_both_tails_of_the_clamp():
    # φ−(W) = √W·exp(2(1−√W)): e^-10·e^2 at log W = −20, and exp(10 + 2(1 − e^10)) = 0 in fp64 at log W = 20.
    assert phi(math.exp(-20.0), DEFAULTS.negative).item() == pytest.approx(math.exp(-10.0 + 2 * (1 - math.exp(-10))))
    assert phi(math.exp(-60.0), DEFAULTS.negative).item() < 1e-12
    assert phi(math.exp(20.0), DEFAULTS.negative).item() == 0.0


@pytest.mark.parametrize("branch", [DEFAULTS.positive, DEFAULTS.negative], ids=["pos", "neg"])
def test_default_branches_are_bounded_by_e_over_two(branch):
    w = torch.logspace(-20, 4, 200_001, dtype=torch.float64)
    values = phi(w, branch)
    assert values.max().item() <= math.e / 2 + 1e-12
    assert values.max().item() == pytest.approx(math.e / 2, rel=1e-6)


@settings(max_examples=100, deadline=None)
@given(alpha=st.floats(1.0, 3.0), beta=st.floats(0.1, 1.0), lam=st.floats(1.0, 4.0))
@example(alpha=1.0000000000000002, beta=0.25, lam=1.0)  # α−1 at machine epsilon: the near-geometric form
def test_supremum_where_peak_is_reachable(alpha, beta, lam):
    # The peak of φ0·exp(λ(1−φ0)) sits at φ0 = 1/λ; with λ ≥ 1 it is reached for some W ≤ 1 whenever the floor
    # of φ0 lies below 1/λ.
    branch = KernelBranch(alpha, beta, lam)
    floor0 = 0.0 if alpha == 1.0 else (1 - beta) ** (1 / (alpha - 1)) if beta < 1 else 0.0
    if floor0 >= 1 / lam:
        return
    w = torch.logspace(-60, 2, 100_001, dtype=torch.float64)
    sup = math.exp(lam - 1) / lam
    peak = phi(w, branch).max().item()
    assert peak <= sup * (1 + 1e-12)
    assert peak == pytest.approx(sup, rel=1e-4)


def test_beta_one_power_mean_is_the_identity_before_the_tilt():
    branch = KernelBranch(alpha=2.0, beta=1.0, lam=0.0)
    w = torch.logspace(-5, 5, 50, dtype=torch.float64)
    torch.testing.assert_close(phi(w, branch), w, rtol=1e-12, atol=0)


def test_alpha_close_to_one_approaches_the_geometric_limit():
    w = torch.logspace(-6, 2, 50, dtype=torch.float64)
    # First order in ε = α−1: Δlog φ0 = ε·β(1−β)(log W)²/2 and Δlog φ = Δlog φ0·(1 − λφ0); on W ∈ [1e-6, 100] with
    # β = 0.5, λ = 2 that is at most about 50ε. Rounding must not add to it, down to ε at machine epsilon.
    for eps in (1e-7, 1e-12, 2.0**-52):
        near = phi(w, KernelBranch(1.0 + eps, 0.5, 2.0))
        torch.testing.assert_close(near, phi(w, KernelBranch(1.0, 0.5, 2.0)), rtol=max(60 * eps, 1e-13), atol=0)


def test_vespo_reference_values_and_peaks():
    cfg = VESPOConfig()

    def vphi(w, k, lam):
        return vespo_log_phi(torch.tensor(w, dtype=torch.float64).log(), k, lam).exp().item()

    assert vphi(0.1, cfg.k_pos, cfg.lambda_pos) == pytest.approx(0.149, abs=5e-4)
    assert vphi(2.0, cfg.k_pos, cfg.lambda_pos) == pytest.approx(0.199, abs=5e-4)
    assert vphi(0.5, cfg.k_neg, cfg.lambda_neg) == pytest.approx(0.340, abs=5e-4)
    assert vphi(2.0, cfg.k_neg, cfg.lambda_neg) == pytest.approx(1.08, abs=5e-3)
    assert vphi(1.0, cfg.k_pos, cfg.lambda_pos) == 1.0
    assert vphi(2 / 3, cfg.k_pos, cfg.lambda_pos) == pytest.approx(1.208, abs=5e-4)
    assert vphi(1.5, cfg.k_neg, cfg.lambda_neg) == pytest.approx(1.242, abs=5e-4)
    # The starvation the paper is about: VESPO's positive weight at W = 0.01 is 0.002, ReSPO's stays ≈ 1.36.
    assert vphi(0.01, cfg.k_pos, cfg.lambda_pos) == pytest.approx(0.002, abs=5e-4)


def test_branch_is_chosen_by_sign():
    log_w = torch.tensor([-3.0, -3.0, 2.0, 2.0], dtype=torch.float64)
    positive = torch.tensor([True, False, True, False])
    got = respo_phi(log_w, positive, DEFAULTS)
    expected = torch.stack(
        [phi(log_w[0].exp(), DEFAULTS.positive), phi(log_w[1].exp(), DEFAULTS.negative),
         phi(log_w[2].exp(), DEFAULTS.positive), phi(log_w[3].exp(), DEFAULTS.negative)]
    )  # fmt: skip
    torch.testing.assert_close(got, expected)
    w = log_w.exp()
    expected_v = torch.where(positive, w**2 * torch.exp(3 * (1 - w)), w**3 * torch.exp(2 * (1 - w)))
    torch.testing.assert_close(vespo_phi(log_w, positive, VESPOConfig()), expected_v)


def test_sequence_log_weight_sums_without_length_normalisation_and_clamps():
    log_prob = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -2.5, -9.0], [-31.0, 5.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    log_w, clamped = sequence_log_weight(log_prob, old, mask, log_w_clip=20.0)
    assert log_w.tolist() == [1.0, 20.0]
    assert clamped.tolist() == [False, True]


def test_rollout_is_weights_enter_log_w_per_level():
    log_prob = torch.zeros(2, 4, dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    token_w = torch.tensor([[2.0, 0.5, 4.0, 100.0], [3.0, 3.0, 7.0, 7.0]], dtype=torch.float64)
    log_w, _ = sequence_log_weight(log_prob, log_prob, mask, 20.0, token_w, "token")
    torch.testing.assert_close(log_w, torch.tensor([math.log(4.0), math.log(9.0)], dtype=torch.float64))
    seq_w = torch.tensor([[2.0] * 4, [0.25] * 4], dtype=torch.float64)  # verl broadcasts one weight per sequence
    log_w, _ = sequence_log_weight(log_prob, log_prob, mask, 20.0, seq_w, "sequence")
    torch.testing.assert_close(log_w, torch.tensor([math.log(2.0), math.log(0.25)], dtype=torch.float64))


def test_vespo_token_clip_applies_before_the_sum():
    log_prob = torch.tensor([[30.0, -5.0]], dtype=torch.float64)
    old = torch.zeros_like(log_prob)
    mask = torch.ones_like(log_prob, dtype=torch.bool)
    clipped, _ = sequence_log_weight(log_prob, old, mask, 20.0, token_log_ratio_clip=20.0)
    unclipped, _ = sequence_log_weight(log_prob, old, mask, 20.0)
    assert clipped.item() == 15.0 and unclipped.item() == 20.0


# The branch ablation (docs/method.md, "Branch ablation"). Hand values of the four default branches at W = 0.1, 0.5, 2
# from their closed forms (math, not the package): ReSPO φ+ = ((1+W)/2)·e^(1−W), ReSPO φ− = √W·e^(2(1−√W)),
# VESPO φ+ = W²·e^(3(1−W)) (k = 2, λ = 3), VESPO φ− = W³·e^(2(1−W)) (k = 3, λ = 2).
HAND_W = (0.1, 0.5, 2.0)
RESPO_POS_HAND = (1.3527817111363225, 1.2365409530250961, 0.5518191617571635)
RESPO_NEG_HAND = (1.2414150787217755, 1.2702488769156, 0.6176375177488974)
VESPO_POS_HAND = (0.1487973172487284, 1.1204222675845161, 0.19914827347145578)
VESPO_NEG_HAND = (0.006049647464412948, 0.33978522855738064, 1.0826822658929016)
HYBRID = HybridConfig(ReSPOConfig(), VESPOConfig())


@pytest.mark.parametrize(
    ("kernel", "positive_values", "negative_values"),
    [
        (respo_pos_phi, RESPO_POS_HAND, VESPO_NEG_HAND),  # ReSPO's positive branch, VESPO's negative
        (respo_neg_phi, VESPO_POS_HAND, RESPO_NEG_HAND),  # VESPO's positive branch, ReSPO's negative
        (phi_one, (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)),
    ],
    ids=["respo_pos", "respo_neg", "phi_one"],
)
def test_ablation_kernels_against_hand_values_on_both_branches(kernel, positive_values, negative_values):
    log_w = torch.tensor(HAND_W * 2, dtype=torch.float64).log()
    positive = torch.tensor([True] * 3 + [False] * 3)
    got = kernel(log_w, positive, HYBRID)
    expected = torch.tensor(positive_values + negative_values, dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    assert kernel(torch.zeros(2, dtype=torch.float64), torch.tensor([True, False]), HYBRID).tolist() == [1.0, 1.0]


def test_hybrids_read_their_branch_parameters_from_the_two_configs():
    config = HybridConfig(ReSPOConfig(alpha_pos=3.0, lambda_neg=1.0), VESPOConfig(k_pos=1.0, k_neg=2.0))
    log_w = torch.tensor([math.log(0.5)] * 2, dtype=torch.float64)
    positive = torch.tensor([True, False])
    respo_pos = respo_pos_phi(log_w, positive, config)
    respo_neg = respo_neg_phi(log_w, positive, config)
    # ReSPO φ+ with α = 3, β = 0.5, λ = 2: φ0 = √((1 + W²)/2); VESPO φ− with k = 2, λ = 2.
    phi0 = math.sqrt((1 + 0.25) / 2)
    assert respo_pos.tolist() == pytest.approx([phi0 * math.exp(2 * (1 - phi0)), 0.25 * math.exp(1.0)], rel=1e-12)
    # VESPO φ+ with k = 1, λ = 3; ReSPO φ− with α = 1, β = 0.5, λ = 1.
    assert respo_neg.tolist() == pytest.approx(
        [0.5 * math.exp(1.5), math.sqrt(0.5) * math.exp(1 - math.sqrt(0.5))], rel=1e-12
    )


def test_hybrids_form_log_w_as_vespo_does_and_phi_one_as_respo_does():
    # One token log-ratio of +25 and one of −10: VESPO clamps the token to 20 before the sum (log W = 10), ReSPO
    # sums unclamped (15).
    log_prob = torch.tensor([[25.0, -10.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    for name, config, log_w in (("respo_pos", HYBRID, 10.0), ("respo_neg", HYBRID, 10.0),
                                ("phi_one", ReSPOConfig(), 15.0)):  # fmt: skip
        assert kernel_terms(name, log_prob, old, adv, mask, config).log_w_seq.item() == log_w, name
    with pytest.raises(TypeError, match="expected a HybridConfig"):
        kernel_terms("respo_pos", log_prob, old, adv, mask, ReSPOConfig())
