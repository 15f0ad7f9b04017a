"""Per-micro-batch diagnostics of a sequence-kernel loss (docs/method.md, "Diagnostics"), as 0-dim tensors (no
host sync).

Branches for the statistics: positive = A_i > 0, negative = A_i < 0 (A_i = 0 carries no gradient and is only
counted in ``zero_adv_frac``); only sequences with at least one valid token count. An empty branch reports 0 for its
statistics, so the key set is the same on every call; its ``frac`` says it was empty.
"""

from __future__ import annotations

import torch

from respo_verl.core.config import DEFAULT_LOG_W_CLIP
from respo_verl.core.kernels import sequence_log_weight
from respo_verl.core.losses import KernelTerms

# A positive sequence counts as "starved" once its weight has drifted below 1/e (arXiv 2609.35433;
# docs/method.md, "Diagnostics").
STARVATION_LOG_W = -1.0
LOG_W_QUANTILES = (0.1, 0.5, 0.9)
# The method-independent starved mass share (:func:`effective_terms`), one key for every loss and every source: verl's
# trainer (respo_verl.verl.starvation) and the miniature log it, the report reads it.
INDEPENDENT_STARVED_MASS_KEY = "actor/starved_mass_share"
BRANCH_STATS = ("frac", "log_w_mean", "log_w_p10", "log_w_p50", "log_w_p90", "phi_mean", "phi_min", "phi_max", "ess")
GLOBAL_STATS = (
    "clamp_frac",
    "zero_adv_frac",
    "starved_frac",
    "starved_mass_share",
    # Counts and sums per micro-batch: verl averages every metric over a step's micro-batches, so ratios of these
    # averages are exact ratios over the step (a ratio per micro-batch, averaged, would not be).
    "pos_count",
    "starved_count",
    "starved_phi_sum",
)


def diagnostic_keys() -> list[str]:
    """Metric names (without prefix) in the order :func:`kernel_diagnostics` returns them."""
    return [f"{b}/{s}" for b in ("pos", "neg") for s in BRANCH_STATS] + list(GLOBAL_STATS)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp(min=torch.finfo(num.dtype).tiny), torch.zeros_like(num))


def masked_quantiles(values: torch.Tensor, member: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """Linear-interpolation quantiles of ``values[member]`` without boolean indexing (which would sync).

    Args:
        values: (B,) float.
        member: (B,) bool.
        qs: quantile levels in [0, 1].

    Returns:
        (len(qs),) quantiles, 0 where ``member`` is empty. Matches ``torch.quantile`` on the selected values.
    """
    n = member.sum()  # ()
    sorted_vals = torch.where(member, values, torch.inf).sort().values  # (B,)
    last = (n - 1).clamp(min=0).to(values.dtype)  # ()
    pos = torch.stack([last * q for q in qs])  # (Q,) built from Python floats: no host-to-device copy
    lo, hi = pos.floor().long(), pos.ceil().long()  # (Q,), (Q,)  1-D indices: a 0-dim one would sync
    lo_val, hi_val = sorted_vals[lo], sorted_vals[hi]  # (Q,), (Q,)
    # lo == hi (an integral position, or an empty set whose values are inf): no interpolation, no inf − inf.
    quantiles = torch.where(lo == hi, lo_val, lo_val + (pos - lo.to(values.dtype)) * (hi_val - lo_val))  # (Q,)
    return torch.where(n > 0, quantiles, 0.0)


def _branch_stats(terms: KernelTerms, member: torch.Tensor, n_valid: torch.Tensor) -> list[torch.Tensor]:
    dtype = terms.log_w_seq.dtype
    n = member.sum().to(dtype)  # ()
    zero = torch.zeros((), dtype=dtype, device=terms.log_w_seq.device)
    phi_in = torch.where(member, terms.phi_seq, zero)  # (B,)
    log_w_in = torch.where(member, terms.log_w_seq, zero)  # (B,)
    phi_sum = phi_in.sum()
    quantiles = masked_quantiles(terms.log_w_seq, member, LOG_W_QUANTILES)  # (3,)
    phi_min = torch.where(member, terms.phi_seq, torch.full_like(terms.phi_seq, torch.inf)).min()
    phi_max = torch.where(member, terms.phi_seq, torch.full_like(terms.phi_seq, -torch.inf)).max()
    return [
        _safe_div(n, n_valid),
        _safe_div(log_w_in.sum(), n),
        quantiles[0],
        quantiles[1],
        quantiles[2],
        _safe_div(phi_sum, n),
        torch.where(n > 0, phi_min, zero),
        torch.where(n > 0, phi_max, zero),
        # Kish effective sample size (Σφ)²/Σφ²: how many sequences effectively carry this branch's gradient.
        _safe_div(phi_sum * phi_sum, (phi_in * phi_in).sum()),
    ]


def _starved_and_mass(terms: KernelTerms, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) starved positives (log W < −1) and (B,) gradient-coefficient mass φ_i·|A_i|·n_tokens_i (0 where invalid)."""
    starved = pos & (terms.log_w_seq < STARVATION_LOG_W)
    valid = terms.n_tok_seq > 0
    mass_seq = torch.where(
        valid,
        terms.phi_seq * terms.adv_seq.abs() * terms.n_tok_seq.to(terms.phi_seq.dtype),
        torch.zeros_like(terms.phi_seq),
    )
    return starved, mass_seq


def kernel_diagnostics(terms: KernelTerms) -> torch.Tensor:
    """The diagnostics of one micro-batch (docs/method.md, "Diagnostics"), in the order of :func:`diagnostic_keys`.

    The starvation share: among valid positive sequences with log W < −1 (``STARVATION_LOG_W``), their share of the
    valid responses (``starved_frac``) and their share of the total gradient-coefficient mass
    Σ φ_i·|A_i|·n_tokens_i (``starved_mass_share``; token-mean weighting). ``pos_count``, ``starved_count`` and
    ``starved_phi_sum`` (the φ those starved positives get, summed) are counts, for ratios over a step: the share of
    positives that starve is ``starved_count / pos_count``, their mean φ ``starved_phi_sum / starved_count``.

    Returns:
        (len(diagnostic_keys()),) detached tensor in the dtype of ``terms.log_w_seq``.
    """
    with torch.no_grad():
        dtype = terms.log_w_seq.dtype
        valid = terms.n_tok_seq > 0  # (B,)
        n_valid = valid.sum().to(dtype)  # ()
        pos = valid & (terms.adv_seq > 0)  # (B,)
        neg = valid & (terms.adv_seq < 0)  # (B,)
        zero_adv = valid & (terms.adv_seq == 0)  # (B,)
        starved, mass_seq = _starved_and_mass(terms, pos)  # (B,), (B,)
        stats = _branch_stats(terms, pos, n_valid) + _branch_stats(terms, neg, n_valid)
        stats += [
            _safe_div((terms.clamped_seq & valid).sum().to(dtype), n_valid),
            _safe_div(zero_adv.sum().to(dtype), n_valid),
            _safe_div(starved.sum().to(dtype), n_valid),
            _safe_div(torch.where(starved, mass_seq, torch.zeros_like(mass_seq)).sum(), mass_seq.sum()),
            pos.sum().to(dtype),
            starved.sum().to(dtype),
            torch.where(starved, terms.phi_seq, torch.zeros_like(terms.phi_seq)).sum(),
        ]
        return torch.stack(stats)


def effective_coefficient(
    grad_log_prob: torch.Tensor, adv_seq: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Per-sequence gradient coefficient of any loss, read from ∂loss/∂log π_θ, in token-mean units.

    For a loss whose gradient on token t of response i is −c_it·A_i/n (token-mean, n = valid tokens of the
    micro-batch), this returns φ_i = n·Σ_t|g_it| / (|A_i|·n_i) = mean_t c_it: exactly the kernel φ(W_i) for ReSPO and
    VESPO, the mean per-token weight (r_t where unclipped, 0 where clipped) for PPO-clip, and for GSPO its sequence
    weight times its seq-mean-token-mean re-weighting by length. Any other normalisation of the loss scales every φ_i
    by one factor, which the shares of :func:`kernel_diagnostics` do not see. Sequences with A_i = 0 get 0.

    Args:
        grad_log_prob: (B, T) gradient of the loss with respect to the log-probabilities.
        adv_seq: (B,) sequence advantages.
        response_mask: (B, T) bool.

    Returns:
        (B,) coefficients.
    """
    n_tok_seq = response_mask.sum(dim=1)  # (B,)
    mass_seq = torch.where(response_mask, grad_log_prob.abs(), 0.0).sum(dim=1)  # (B,)
    denom = adv_seq.abs() * n_tok_seq  # (B,)
    n_total = n_tok_seq.sum().clamp(min=1)
    return torch.where(denom > 0, mass_seq * n_total / denom.clamp(min=1e-30), 0.0)


def effective_terms(
    log_prob: torch.Tensor,
    grad_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    log_w_clip: float = DEFAULT_LOG_W_CLIP,
) -> KernelTerms:
    """The terms :func:`kernel_diagnostics` reads, for any loss: φ the effective coefficient the loss gave each
    sequence (:func:`effective_coefficient`), log W formed as ReSPO forms it (no token clamp, the sum clamped to
    ±``log_w_clip``). All (B, T) inputs; the result carries no gradient and its ``loss_tok`` is zeros."""
    with torch.no_grad():
        mask = response_mask.to(torch.bool)
        dtype = torch.promote_types(torch.float32, log_prob.dtype)
        log_prob, old_log_prob = log_prob.to(dtype), old_log_prob.to(dtype)
        log_w_seq, clamped_seq = sequence_log_weight(log_prob, old_log_prob, mask, log_w_clip)  # (B,), (B,)
        n_tok_seq = mask.sum(dim=1)  # (B,)
        adv_seq = torch.where(mask, advantages.to(dtype), 0.0).sum(dim=1) / n_tok_seq.clamp(min=1)  # (B,)
        return KernelTerms(
            loss_tok=torch.zeros_like(log_prob),
            response_mask=mask,
            log_w_seq=log_w_seq,
            clamped_seq=clamped_seq,
            phi_seq=effective_coefficient(grad_log_prob.to(dtype), adv_seq, mask),
            adv_seq=adv_seq,
            n_tok_seq=n_tok_seq,
            nonfinite_counts=torch.zeros(3, dtype=dtype, device=log_prob.device),
        )


def starved_mass_share(terms: KernelTerms) -> torch.Tensor:
    """The ``starved_mass_share`` of :func:`kernel_diagnostics` alone, as a detached 0-dim tensor (no host sync)."""
    with torch.no_grad():
        pos = (terms.n_tok_seq > 0) & (terms.adv_seq > 0)  # (B,)
        starved, mass_seq = _starved_and_mass(terms, pos)  # (B,), (B,)
        return _safe_div(torch.where(starved, mass_seq, torch.zeros_like(mass_seq)).sum(), mass_seq.sum())
