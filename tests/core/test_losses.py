"""The per-token loss on plain tensors: gradient form, precision, extremes, masking, bad input, diagnostics."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from respo_verl.core import diagnostic_keys, kernel_diagnostics, raise_on_nonfinite, respo_terms, vespo_terms
from respo_verl.core.config import ReSPOConfig, VESPOConfig
from respo_verl.core.diagnostics import masked_quantiles
from respo_verl.core.kernels import respo_phi, vespo_phi

TERMS = {"respo": (respo_terms, ReSPOConfig(), respo_phi), "vespo": (vespo_terms, VESPOConfig(), vespo_phi)}


def make_batch(batch=6, length=9, seed=0, dtype=torch.float64, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g, dtype=dtype) * 3
    log_prob = (old + scale * torch.randn(batch, length, generator=g, dtype=dtype)).requires_grad_(True)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.where(torch.rand(batch, generator=g) < 0.5, -1.0, 1.0).to(dtype) * torch.rand(batch, generator=g)
    return log_prob, old, adv.unsqueeze(1).expand(batch, length).clone() * mask, mask


def token_mean(terms):
    return terms.loss_tok.sum() / terms.response_mask.sum()


@pytest.mark.parametrize("name", ["respo", "vespo"])
def test_gradient_is_minus_phi_times_advantage_over_normaliser(name):
    fn, cfg, phi_fn = TERMS[name]
    log_prob, old, adv, mask = make_batch()
    terms = fn(log_prob, old, adv, mask, cfg)
    token_mean(terms).backward()
    log_w = ((log_prob.detach() - old) * mask).sum(-1)
    phi = phi_fn(log_w, adv.sum(-1) >= 0, cfg)
    expected = torch.where(mask, -phi.unsqueeze(1) * adv / mask.sum(), torch.zeros_like(adv))
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["respo", "vespo"])
def test_float32_agrees_with_float64(name):
    fn, cfg, _ = TERMS[name]
    lp64, old64, adv64, mask = make_batch(dtype=torch.float64, scale=1.0)
    lp32 = lp64.detach().float().requires_grad_(True)
    t64 = fn(lp64, old64, adv64, mask, cfg)
    t32 = fn(lp32, old64.float(), adv64.float(), mask, cfg)
    token_mean(t64).backward()
    token_mean(t32).backward()
    assert t32.loss_tok.dtype == torch.float32
    torch.testing.assert_close(t32.phi_seq.double(), t64.phi_seq, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lp32.grad.double(), lp64.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(kernel_diagnostics(t32).double(), kernel_diagnostics(t64), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["respo", "vespo"])
@pytest.mark.parametrize("delta", [1e4, -1e4])
def test_extreme_token_log_ratios_stay_finite(name, delta):
    fn, cfg, _ = TERMS[name]
    log_prob, old, adv, mask = make_batch(dtype=torch.float32)
    log_prob = (old + delta).requires_grad_(True)
    terms = fn(log_prob, old, adv, mask, cfg)
    loss = token_mean(terms)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()
    diag = dict(zip(diagnostic_keys(), kernel_diagnostics(terms).tolist()))
    assert all(math.isfinite(v) for v in diag.values())
    assert diag["clamp_frac"] == 1.0
    assert terms.log_w_seq.abs().max().item() == cfg.log_w_clip


@pytest.mark.parametrize("name", ["respo", "vespo"])
def test_masked_tokens_change_nothing(name):
    fn, cfg, _ = TERMS[name]
    log_prob, old, adv, mask = make_batch()
    base = fn(log_prob, old, adv, mask, cfg)
    token_mean(base).backward()
    grad = log_prob.grad.clone()
    junk = torch.tensor([math.nan, math.inf, -math.inf, 1e30], dtype=old.dtype).repeat(mask.numel())[: mask.numel()]
    junk = junk.view_as(old)
    lp2 = torch.where(mask, log_prob.detach(), junk).requires_grad_(True)
    terms = fn(lp2, torch.where(mask, old, junk), torch.where(mask, adv, junk), mask, cfg)
    token_mean(terms).backward()
    assert int(terms.nonfinite_counts.sum()) == 0
    torch.testing.assert_close(terms.loss_tok, base.loss_tok.detach(), rtol=0, atol=0)
    torch.testing.assert_close(lp2.grad, grad, rtol=0, atol=0)
    assert (lp2.grad[~mask] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_are_computed_in_float32(dtype):
    log_prob, old, adv, mask = make_batch(dtype=torch.float32, scale=1.0)
    lp_half = log_prob.detach().to(dtype).requires_grad_(True)
    terms = respo_terms(lp_half, old.to(dtype), adv.to(dtype), mask, ReSPOConfig())
    assert terms.loss_tok.dtype == terms.phi_seq.dtype == terms.log_w_seq.dtype == torch.float32
    reference = respo_terms(lp_half.detach().float(), old.to(dtype).float(), adv.to(dtype).float(), mask, ReSPOConfig())
    torch.testing.assert_close(terms.phi_seq, reference.phi_seq, rtol=0, atol=0)
    token_mean(terms).backward()
    assert lp_half.grad.dtype == dtype and torch.isfinite(lp_half.grad.float()).all()


def test_nonfinite_inputs_are_counted_per_tensor_and_raise_with_names():
    log_prob, old, adv, mask = make_batch()
    row, col = 0, 0
    assert mask[row, col]
    lp = log_prob.detach().clone()
    lp[row, col] = math.nan
    adv = adv.clone()
    adv[1, 0] = math.inf
    adv[2, 0] = -math.inf
    terms = respo_terms(lp, old, adv, mask, ReSPOConfig())
    assert terms.nonfinite_counts.tolist() == [1, 0, 2]
    with pytest.raises(FloatingPointError, match=r"log_prob: 1, advantages: 2 of \d+ valid tokens"):
        raise_on_nonfinite(terms.nonfinite_counts.tolist(), int(mask.sum()), "respo")
    raise_on_nonfinite([0, 0, 0], 10, "respo")  # nothing to report


@pytest.mark.parametrize(
    "field, shape", [("old_log_prob", (6, 8)), ("advantages", (6,)), ("response_mask", (5, 9)), ("rollout", (6, 1))]
)
def test_shape_mismatch_raises_naming_the_tensor(field, shape):
    log_prob, old, adv, mask = make_batch()
    args = {"old_log_prob": old, "advantages": adv, "response_mask": mask, "rollout": None}
    args[field] = torch.ones(shape, dtype=torch.bool if field == "response_mask" else old.dtype)
    name = "rollout_is_weights" if field == "rollout" else field
    with pytest.raises(ValueError, match=name):
        respo_terms(log_prob, args["old_log_prob"], args["advantages"], args["response_mask"], ReSPOConfig(),
                    rollout_is_weights=args["rollout"])  # fmt: skip


def test_log_prob_must_be_two_dimensional():
    with pytest.raises(ValueError, match="batch, response_length"):
        respo_terms(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.ones(4, dtype=torch.bool), ReSPOConfig())


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_batch_permutation_permutes_outputs(seed):
    log_prob, old, adv, mask = make_batch(batch=7, seed=seed, scale=2.0)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(seed))
    a = respo_terms(log_prob.detach(), old, adv, mask, ReSPOConfig())
    b = respo_terms(log_prob.detach()[perm], old[perm], adv[perm], mask[perm], ReSPOConfig())
    torch.testing.assert_close(b.phi_seq, a.phi_seq[perm], rtol=0, atol=0)
    torch.testing.assert_close(b.loss_tok, a.loss_tok[perm], rtol=0, atol=0)
    torch.testing.assert_close(kernel_diagnostics(b), kernel_diagnostics(a), rtol=1e-12, atol=1e-12)


def test_diagnostics_on_a_hand_built_batch():
    # Five responses: lengths 4, 2, 3, 1, 0 (the last is empty); advantages +1, +1, −1, 0, +1; log W = −3, 0.5, 1, 0.
    length = 4
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    old = torch.zeros(5, length, dtype=torch.float64)
    log_prob = torch.tensor([[-0.75] * 4, [0.25] * 4, [1 / 3] * 4, [0.0] * 4, [9.0] * 4], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, 0.0, 1.0], dtype=torch.float64).unsqueeze(1) * mask
    terms = respo_terms(log_prob, old, adv, mask, ReSPOConfig())
    diag = dict(zip(diagnostic_keys(), kernel_diagnostics(terms).tolist()))
    cfg = ReSPOConfig()
    phi_p = [math.exp(x) for x in (-3.0, 0.5)]
    phi_p = [(1 + w) / 2 * math.exp(1 - w) for w in phi_p]
    phi_n = math.exp(0.5) * math.exp(2 * (1 - math.exp(0.5)))
    assert cfg.alpha_pos == 2 and cfg.alpha_neg == 1  # the closed forms above are for the defaults
    approx = lambda x: pytest.approx(x, rel=1e-12, abs=1e-12)  # noqa: E731
    assert diag["pos/frac"] == approx(2 / 4) and diag["neg/frac"] == approx(1 / 4)
    assert diag["zero_adv_frac"] == approx(1 / 4)
    assert diag["pos/log_w_mean"] == approx(-1.25)
    assert diag["pos/log_w_p50"] == approx(-1.25) and diag["pos/log_w_p10"] == approx(-3 + 0.1 * 3.5)
    assert diag["pos/phi_min"] == approx(min(phi_p)) and diag["pos/phi_max"] == approx(max(phi_p))
    assert diag["pos/phi_mean"] == approx(sum(phi_p) / 2)
    assert diag["pos/ess"] == approx(sum(phi_p) ** 2 / sum(p * p for p in phi_p))
    assert diag["neg/phi_mean"] == approx(phi_n) and diag["neg/ess"] == approx(1.0)
    assert diag["neg/log_w_p90"] == approx(1.0)
    assert diag["clamp_frac"] == approx(0.0)
    # Starved: the positive response with log W = −3 (< −1): 1 of 4 valid responses; mass φ·|A|·n_tokens.
    mass = [phi_p[0] * 4, phi_p[1] * 2, phi_n * 3, 0.0]
    assert diag["starved_frac"] == approx(1 / 4)
    assert diag["starved_mass_share"] == approx(mass[0] / sum(mass))
    # Counts for ratios over a step: 2 valid positives (the fifth response is empty), 1 starved, and its φ.
    assert diag["pos_count"] == 2 and diag["starved_count"] == 1
    assert diag["starved_phi_sum"] == approx(phi_p[0])


def test_empty_batch_and_zero_advantages_give_finite_zero_metrics():
    mask = torch.zeros(3, 5, dtype=torch.bool)
    zeros = torch.zeros(3, 5)
    terms = respo_terms(zeros.clone().requires_grad_(True), zeros, zeros, mask, ReSPOConfig())
    assert kernel_diagnostics(terms).tolist() == [0.0] * len(diagnostic_keys())
    log_prob, old, adv, mask = make_batch()
    terms = vespo_terms(log_prob, old, torch.zeros_like(adv), mask, VESPOConfig())
    loss = token_mean(terms)
    loss.backward()
    assert loss.item() == 0.0 and (log_prob.grad == 0).all()
    diag = dict(zip(diagnostic_keys(), kernel_diagnostics(terms).tolist()))
    assert diag["zero_adv_frac"] == 1.0 and diag["pos/frac"] == 0.0 and diag["starved_mass_share"] == 0.0


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 30), seed=st.integers(0, 1000), q=st.sampled_from([(0.1, 0.5, 0.9), (0.0, 0.25, 1.0)]))
def test_masked_quantiles_match_torch_quantile(n, seed, q):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=g, dtype=torch.float64)
    member = torch.rand(n, generator=g) < 0.6
    got = masked_quantiles(values, member, q)
    if member.any():
        torch.testing.assert_close(got, torch.quantile(values[member], torch.tensor(q, dtype=torch.float64)))
    else:
        assert got.tolist() == [0.0] * len(q)


def test_core_imports_without_any_framework():
    code = textwrap.dedent(
        """
        import importlib.abc, sys
        BLOCKED = ("verl", "megatron", "ray", "hydra", "omegaconf", "transformers")

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked in this test: {name}")
                return None

        sys.meta_path.insert(0, Block())
        import torch
        import respo_verl, respo_verl.core
        from respo_verl.core import ReSPOConfig, respo_terms, kernel_diagnostics, group_relative_advantage
        mask = torch.ones(2, 3, dtype=torch.bool)
        t = respo_terms(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), mask, ReSPOConfig())
        kernel_diagnostics(t)
        group_relative_advantage(torch.ones(2, 3), mask, ["a", "a"])
        assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED], sorted(sys.modules)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize(("terms_fn", "config_class"), [(respo_terms, ReSPOConfig), (vespo_terms, VESPOConfig)])
def test_rollout_is_weights_fold_into_log_w_of_the_loss(terms_fn, config_class):
    """Token level adds Σ_t log w_t over valid tokens; sequence level adds log w once; masked weights are ignored."""
    log_prob = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.7, 0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.1, -0.9, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    advantages = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64)
    delta = [0.5 - 1.0 + 0.0, -0.2 + 0.2]  # Σ_t (log π − log μ) over valid tokens, by hand
    # Padding holds weights that would change the sum if they were read (nan, inf, 0).
    token_w = torch.tensor([[2.0, 0.5, 3.0, math.nan], [0.25, 5.0, math.inf, 0.0]], dtype=torch.float64)
    terms = terms_fn(log_prob, old, advantages, mask, config_class(rollout_is_level="token"), token_w)
    expected = [delta[0] + math.log(2.0 * 0.5 * 3.0), delta[1] + math.log(0.25 * 5.0)]
    torch.testing.assert_close(terms.log_w_seq, torch.tensor(expected, dtype=torch.float64))
    # verl broadcasts one sequence-level weight over the valid tokens: it enters once, not once per token.
    seq_w = torch.tensor([[4.0, 4.0, 4.0, math.nan], [0.5, 0.5, 0.0, math.inf]], dtype=torch.float64)
    terms = terms_fn(log_prob, old, advantages, mask, config_class(rollout_is_level="sequence"), seq_w)
    expected = [delta[0] + math.log(4.0), delta[1] + math.log(0.5)]
    torch.testing.assert_close(terms.log_w_seq, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(terms.phi_seq.isfinite(), torch.tensor([True, True]))


@pytest.mark.parametrize(("terms_fn", "wrong"), [(respo_terms, VESPOConfig()), (vespo_terms, ReSPOConfig()),
                                                 (respo_terms, {"alpha_pos": 2.0})])  # fmt: skip
def test_a_config_of_another_kernel_is_refused(terms_fn, wrong):
    log_prob, old, advantages, mask = make_batch()
    with pytest.raises(TypeError, match=r"expected a (ReSPO|VESPO)Config, got"):
        terms_fn(log_prob, old, advantages, mask, wrong)
