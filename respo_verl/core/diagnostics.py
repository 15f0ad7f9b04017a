"""Per-micro-batch diagnostics of a sequence-kernel loss (docs/method.md, "Diagnostics"), as 0-dim tensors (no
host sync).

Branches for the statistics: positive = A_i > 0, negative = A_i < 0 (A_i = 0 carries no gradient and is only
counted in ``zero_adv_frac``); only sequences with at least one valid token count. An empty branch reports 0 for its
statistics, so the key set is the same on every call; its ``frac`` says it was empty.
"""

from __future__ import annotations

import torch

from respo_verl.core.losses import KernelTerms

# A positive sequence counts as "starved" once its weight has drifted below 1/e (arXiv 2609.35433;
# docs/method.md, "Diagnostics").
STARVATION_LOG_W = -1.0
LOG_W_QUANTILES = (0.1, 0.5, 0.9)
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
        starved = pos & (terms.log_w_seq < STARVATION_LOG_W)  # (B,)
        mass_seq = torch.where(
            valid, terms.phi_seq * terms.adv_seq.abs() * terms.n_tok_seq.to(dtype), torch.zeros_like(terms.phi_seq)
        )  # (B,)
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
