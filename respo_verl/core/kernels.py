"""Sequence-level importance weights and the kernels φ(W) that reshape them.

Everything here works on per-sequence tensors in log space, because W = π_θ/μ of a long response spans e^±20, and
returns detached values: the kernels are used as stop-gradient coefficients in a REINFORCE-form loss
(docs/method.md, "Loss").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from respo_verl.core.config import KernelBranch, ReSPOConfig, VESPOConfig


def sequence_log_weight(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    log_w_clip: float,
    rollout_is_weights: torch.Tensor | None = None,
    rollout_is_level: str = "token",
    token_log_ratio_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence log-weight log W_i = Σ_t m_it (log π_θ − log μ), clamped to [−C, C] (docs/method.md, "Sequence weight").

    No length normalisation (unlike GSPO). Everything is computed without gradient.

    Args:
        log_prob: (B, T) log π_θ of the response tokens.
        old_log_prob: (B, T) log μ (π_old recomputed by the trainer, or the rollout engine's in bypass mode).
        response_mask: (B, T) bool, True on valid response tokens.
        log_w_clip: C in the clamp.
        rollout_is_weights: optional (B, T) verl rollout-correction weights π_old/π_rollout; their log is added to
            log W (summed over tokens for ``token`` level, taken once per sequence for ``sequence`` level, where
            verl broadcasts one weight over all tokens).
        rollout_is_level: ``token`` or ``sequence``.
        token_log_ratio_clip: if set, each token log-ratio is clamped to ±this before summing (VESPO does).

    Returns:
        ``(log_w_seq, clamped_seq)``: (B,) clamped log W in the dtype of the inputs, and (B,) bool, True where the
        clamp was active.
    """
    mask = response_mask.to(torch.bool)
    with torch.no_grad():
        delta_tok = log_prob.detach() - old_log_prob.detach()  # (B, T)
        if token_log_ratio_clip is not None:
            delta_tok = delta_tok.clamp(-token_log_ratio_clip, token_log_ratio_clip)
        # torch.where rather than a product, so that padding holding inf/nan cannot leak into the sum.
        log_w_seq = torch.where(mask, delta_tok, 0.0).sum(dim=-1)  # (B,)
        if rollout_is_weights is not None:
            log_is_tok = torch.where(mask, rollout_is_weights.detach().to(log_w_seq.dtype), 1.0).log()  # (B, T)
            log_is_seq = log_is_tok.sum(dim=-1)  # (B,)
            if rollout_is_level == "sequence":
                log_is_seq = log_is_seq / mask.sum(dim=-1).clamp(min=1)
            elif rollout_is_level != "token":
                raise ValueError(f"rollout_is_level must be 'token' or 'sequence', got {rollout_is_level!r}")
            log_w_seq = log_w_seq + log_is_seq
        clamped_seq = log_w_seq.abs() > log_w_clip  # (B,)
        log_w_seq = log_w_seq.clamp(-log_w_clip, log_w_clip)  # (B,)
    return log_w_seq, clamped_seq


def respo_log_phi(log_w: torch.Tensor, branch: KernelBranch) -> torch.Tensor:
    """log φ(W; α, β, λ) of the ReSPO family in log space (arXiv 2609.35433; docs/method.md, "ReSPO kernels").

    φ0(W) = [(1−β) + β·W^(α−1)]^(1/(α−1)) for α > 1 (power mean of 1 and W), W^β for α = 1 (geometric limit);
    φ(W) = φ0 · exp(λ(1 − φ0)).

    Args:
        log_w: (...) log W, any float dtype; finite.
        branch: (α, β, λ).

    Returns:
        (...) log φ, detached, same dtype as ``log_w``.
    """
    log_w = log_w.detach()
    alpha, beta, lam = branch.alpha, branch.beta, branch.lam
    if alpha == 1.0:
        log_phi0 = beta * log_w
    else:
        power = alpha - 1.0
        scaled = power * log_w  # (...) (α−1)·log W
        # log(1−β) is −inf for β = 1, which logaddexp handles exactly (φ0 = W).
        log_one_minus_beta = math.log1p(-beta) if beta < 1.0 else -math.inf
        general = torch.logaddexp(torch.full_like(log_w, log_one_minus_beta), math.log(beta) + scaled) / power
        # For α → 1 the division by α−1 amplifies rounding in logaddexp; log1p(β·expm1(x))/(α−1) is the same
        # quantity, exact to rounding near the geometric limit, and well conditioned while |(α−1)·log W| < 1.
        near_geometric = torch.log1p(beta * torch.expm1(scaled.clamp(-1.0, 1.0))) / power
        log_phi0 = torch.where(scaled.abs() < 1.0, near_geometric, general)
    return log_phi0 + lam * (1.0 - log_phi0.exp())


def vespo_log_phi(log_w: torch.Tensor, k: float, lam: float) -> torch.Tensor:
    """log φ(W) = k·log W + λ(1 − W) of the VESPO kernel (arXiv 2602.10693; docs/method.md, "VESPO"), detached."""
    log_w = log_w.detach()
    return k * log_w + lam * (1.0 - log_w.exp())


def respo_phi(log_w_seq: torch.Tensor, positive_seq: torch.Tensor, config: ReSPOConfig) -> torch.Tensor:
    """Two-branch ReSPO coefficient per sequence.

    Args:
        log_w_seq: (B,) clamped sequence log-weights.
        positive_seq: (B,) bool, True where the sequence advantage is ≥ 0 (positive branch).
        config: kernel hyperparameters.

    Returns:
        (B,) φ(W_i), detached.
    """
    log_phi_pos = respo_log_phi(log_w_seq, config.positive)  # (B,)
    log_phi_neg = respo_log_phi(log_w_seq, config.negative)  # (B,)
    return torch.where(positive_seq, log_phi_pos, log_phi_neg).exp()


def vespo_phi(log_w_seq: torch.Tensor, positive_seq: torch.Tensor, config: VESPOConfig) -> torch.Tensor:
    """Two-branch VESPO coefficient per sequence; shapes as :func:`respo_phi`."""
    log_phi_pos = vespo_log_phi(log_w_seq, config.k_pos, config.lambda_pos)  # (B,)
    log_phi_neg = vespo_log_phi(log_w_seq, config.k_neg, config.lambda_neg)  # (B,)
    return torch.where(positive_seq, log_phi_pos, log_phi_neg).exp()


# The branch ablation (docs/method.md, "Branch ablation"): ReSPO and VESPO differ on both branches, so each hybrid
# swaps one branch. Their log W is formed VESPO's way (each token log-ratio clamped to ±C, then the sum): a hybrid
# then differs from VESPO in exactly one branch's kernel, which is the comparison the ablation's gap decomposition
# (hybrid − VESPO) makes.


@dataclass(frozen=True)
class HybridConfig:
    """The two kernel configs a branch hybrid draws on; it adds no hyperparameter of its own.

    Attributes:
        respo: the ReSPO branch parameters (:class:`ReSPOConfig`; its ``log_w_clip`` and ``rollout_is_level`` are
            not read).
        vespo: the VESPO branch parameters and the formation of log W (``log_w_clip``, ``rollout_is_level``,
            token log-ratio clamp), as in :class:`VESPOConfig`.
    """

    respo: ReSPOConfig
    vespo: VESPOConfig

    @property
    def log_w_clip(self) -> float:
        return self.vespo.log_w_clip

    @property
    def rollout_is_level(self) -> str:
        return self.vespo.rollout_is_level


def respo_pos_phi(log_w_seq: torch.Tensor, positive_seq: torch.Tensor, config: HybridConfig) -> torch.Tensor:
    """ReSPO's positive branch with VESPO's negative branch: φ+ = ReSPO φ(W; α+, β+, λ+), φ− = W^k−·e^{λ−(1−W)}.

    Args:
        log_w_seq: (B,) clamped sequence log-weights.
        positive_seq: (B,) bool, True where the sequence advantage is ≥ 0.
        config: the two kernel configs.

    Returns:
        (B,) φ(W_i), detached.
    """
    log_phi_pos = respo_log_phi(log_w_seq, config.respo.positive)  # (B,)
    log_phi_neg = vespo_log_phi(log_w_seq, config.vespo.k_neg, config.vespo.lambda_neg)  # (B,)
    return torch.where(positive_seq, log_phi_pos, log_phi_neg).exp()


def respo_neg_phi(log_w_seq: torch.Tensor, positive_seq: torch.Tensor, config: HybridConfig) -> torch.Tensor:
    """VESPO's positive branch with ReSPO's negative branch: φ+ = W^k+·e^{λ+(1−W)}, φ− = ReSPO φ(W; α−, β−, λ−).

    Shapes as :func:`respo_pos_phi`.
    """
    log_phi_pos = vespo_log_phi(log_w_seq, config.vespo.k_pos, config.vespo.lambda_pos)  # (B,)
    log_phi_neg = respo_log_phi(log_w_seq, config.respo.negative)  # (B,)
    return torch.where(positive_seq, log_phi_pos, log_phi_neg).exp()


def phi_one(log_w_seq: torch.Tensor, positive_seq: torch.Tensor, config: object) -> torch.Tensor:
    """φ ≡ 1 on both branches: the uncorrected sequence-level policy gradient −A·log π (no importance weight).

    ``log_w_seq`` only sets the shape and dtype (it is still formed, for the diagnostics); ``config`` is not read.

    Returns:
        (B,) ones, detached.
    """
    return torch.ones_like(log_w_seq.detach())
