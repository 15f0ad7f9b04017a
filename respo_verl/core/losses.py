"""Kernel policy losses on plain tensors: input checks, the per-token loss matrix, the per-sequence terms.

The loss is the REINFORCE form with a detached sequence coefficient (docs/method.md, "Loss"):

    ℓ_it = − sg[φ(W_i)] · A_it · log π_θ(o_it)

so that ∂ℓ_it/∂log π_θ(o_it) = −φ(W_i)·A_it on every valid token. Aggregation over tokens is left to the caller
(verl's ``agg_loss``), which owns the normalisation across micro-batches and data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from respo_verl.core.config import CONFIG_BLOCKS, ReSPOConfig, VESPOConfig
from respo_verl.core.kernels import (
    HybridConfig,
    phi_one,
    respo_neg_phi,
    respo_phi,
    respo_pos_phi,
    sequence_log_weight,
    vespo_phi,
)

CHECKED_TENSORS = ("log_prob", "old_log_prob", "advantages")


@dataclass
class KernelTerms:
    """Everything a kernel loss computes on one micro-batch; shapes (B, T) for ``_tok``, (B,) for ``_seq``."""

    loss_tok: torch.Tensor  # (B, T) per-token loss, 0 on masked tokens; carries the gradient
    response_mask: torch.Tensor  # (B, T) bool
    log_w_seq: torch.Tensor  # (B,) clamped sequence log-weight
    clamped_seq: torch.Tensor  # (B,) bool, clamp active
    phi_seq: torch.Tensor  # (B,) detached kernel coefficient
    adv_seq: torch.Tensor  # (B,) sequence advantage (mean over valid tokens)
    n_tok_seq: torch.Tensor  # (B,) number of valid tokens
    nonfinite_counts: torch.Tensor  # (3,) non-finite valid entries of log_prob, old_log_prob, advantages


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32 for half-precision inputs, fp64 when any input is fp64: the kernels never run in bf16/fp16."""
    dtype = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def check_shapes(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
) -> None:
    """Raise ValueError unless every input is (B, T) with the shape of ``log_prob``."""
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be (batch, response_length), got shape {tuple(log_prob.shape)}")
    named = {"old_log_prob": old_log_prob, "advantages": advantages, "response_mask": response_mask}
    if rollout_is_weights is not None:
        named["rollout_is_weights"] = rollout_is_weights
    for name, tensor in named.items():
        if tensor.shape != log_prob.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but log_prob has shape {tuple(log_prob.shape)}; "
                "all loss inputs must be (batch, response_length)"
            )


def nonfinite_counts(
    response_mask: torch.Tensor, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """(3,) int64 counts of inf/nan on valid tokens, in the order of ``CHECKED_TENSORS``; no host sync."""
    mask = response_mask.to(torch.bool)
    return torch.stack(
        [(~torch.isfinite(t.detach()) & mask).sum() for t in (log_prob, old_log_prob, advantages)]
    )  # (3,)


def raise_on_nonfinite(counts: Sequence[int | float], n_valid_tokens: int | float, loss_name: str) -> None:
    """Raise FloatingPointError naming each tensor holding inf/nan on valid tokens, with its count.

    A diverged model must stop the run: replacing such values by zeros would train on garbage without a trace.
    """
    bad = [f"{name}: {int(c)}" for name, c in zip(CHECKED_TENSORS, counts) if c]
    if bad:
        raise FloatingPointError(
            f"{loss_name} loss received non-finite values on valid response tokens ({', '.join(bad)} of "
            f"{int(n_valid_tokens)} valid tokens). The policy or the advantages have diverged; stopping rather "
            "than training on them."
        )


def kernel_loss_tok(
    log_prob: torch.Tensor, phi_seq: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Per-token loss ℓ_it = −sg[φ_i]·A_it·log π_θ(o_it), 0 on masked tokens.

    Args:
        log_prob: (B, T), differentiable.
        phi_seq: (B,) kernel coefficient (detached here).
        advantages: (B, T) token advantages (detached here).
        response_mask: (B, T) bool.

    Returns:
        (B, T) loss matrix in the dtype of ``log_prob``.
    """
    # where(), not a product: padded positions may hold anything (even nan) and must not reach the sum or gradient.
    advantages = torch.where(response_mask, advantages.detach(), 0.0)  # (B, T)
    coeff_tok = phi_seq.detach().unsqueeze(-1) * advantages  # (B, T)
    return torch.where(response_mask, -coeff_tok * log_prob, 0.0)


def _sequence_advantage(advantages: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) mean advantage over valid tokens (GRPO broadcasts one value, so this is that value) and (B,) counts."""
    n_tok_seq = mask.sum(dim=-1)  # (B,)
    adv_sum_seq = torch.where(mask, advantages.detach(), 0.0).sum(dim=-1)  # (B,)
    return adv_sum_seq / n_tok_seq.clamp(min=1), n_tok_seq


@dataclass(frozen=True)
class KernelSpec:
    """One kernel loss: its φ, the config blocks it reads, how its log W is formed, and what it is.

    Attributes:
        phi: ``phi(log_w_seq, positive_seq, config) -> (B,)``.
        blocks: the hyperparameter blocks it reads, keys of :data:`respo_verl.core.config.CONFIG_BLOCKS` (under
            ``actor_rollout_ref.actor.policy_loss.<block>``): one block gives that block's config, two a
            :class:`HybridConfig` of both (ReSPO's, then VESPO's).
        clamp_token_log_ratio: clamp every token log-ratio to ±``log_w_clip`` before summing (VESPO does).
        doc: what the loss is, for its registered function's docstring.
    """

    phi: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
    blocks: tuple[str, ...]
    clamp_token_log_ratio: bool
    doc: str

    @property
    def config_class(self) -> type:
        """The config the kernel reads (any other object is refused, never read as this one)."""
        return HybridConfig if len(self.blocks) == 2 else CONFIG_BLOCKS[self.blocks[0]]


# The kernel losses, by verl loss name: the one table that the registered losses, the plugin's list and the
# preflight's check derive from (docs/method.md, "Adding a kernel").
# The ablation kernels (docs/method.md, "Branch ablation"): the hybrids form log W VESPO's way (token clamp), so that
# each differs from VESPO in one branch only; phi_one forms it ReSPO's way, for its diagnostics only (φ ≡ 1 does not
# read it).
KERNELS = {
    "respo": KernelSpec(
        respo_phi, ("respo",), clamp_token_log_ratio=False,
        doc="ReSPO policy loss (arXiv 2609.35433): φ is the two-branch ReSPO kernel (``docs/method.md, \"ReSPO "
        "kernels\"``) of the clamped sequence weight W_i, chosen by the sign of the sequence advantage; "
        "hyperparameters from ``config.policy_loss.respo``.",
    ),
    "vespo": KernelSpec(
        vespo_phi, ("vespo",), clamp_token_log_ratio=True,
        doc="VESPO policy loss (arXiv 2602.10693), the baseline: φ(W) = W^k·exp(λ(1−W)) per branch; hyperparameters "
        "from ``config.policy_loss.vespo``.",
    ),
    "respo_pos": KernelSpec(
        respo_pos_phi, ("respo", "vespo"), clamp_token_log_ratio=True,
        doc="Branch ablation: ReSPO's positive kernel (``policy_loss.respo``) with VESPO's negative kernel "
        "(``policy_loss.vespo``); log W formed as VESPO forms it (token log-ratios clamped to ±C, then the sum).",
    ),
    "respo_neg": KernelSpec(
        respo_neg_phi, ("respo", "vespo"), clamp_token_log_ratio=True,
        doc="Branch ablation: VESPO's positive kernel (``policy_loss.vespo``) with ReSPO's negative kernel "
        "(``policy_loss.respo``); log W formed as VESPO forms it.",
    ),
    "phi_one": KernelSpec(
        phi_one, ("respo",), clamp_token_log_ratio=False,
        doc="Branch ablation: φ ≡ 1, the uncorrected sequence-level policy gradient ℓ_it = −A_it·log π_θ(o_it); "
        "log W (ReSPO's formation, ``policy_loss.respo``) only feeds the diagnostics.",
    ),
}  # fmt: skip


def _kernel_terms(
    spec: KernelSpec,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: ReSPOConfig | VESPOConfig | HybridConfig,
    rollout_is_weights: torch.Tensor | None,
) -> KernelTerms:
    if not isinstance(config, spec.config_class):
        raise TypeError(f"expected a {spec.config_class.__name__}, got {type(config).__name__}")
    check_shapes(log_prob, old_log_prob, advantages, response_mask, rollout_is_weights)
    mask = response_mask.to(torch.bool)
    counts = nonfinite_counts(mask, log_prob, old_log_prob, advantages)  # (3,)
    dtype = compute_dtype(log_prob, old_log_prob, advantages)
    log_prob = log_prob.to(dtype)
    old_log_prob = old_log_prob.to(dtype)
    advantages = advantages.to(dtype)
    if rollout_is_weights is not None:
        rollout_is_weights = rollout_is_weights.to(dtype)
    log_w_seq, clamped_seq = sequence_log_weight(
        log_prob,
        old_log_prob,
        mask,
        log_w_clip=config.log_w_clip,
        rollout_is_weights=rollout_is_weights,
        rollout_is_level=config.rollout_is_level,
        token_log_ratio_clip=config.log_w_clip if spec.clamp_token_log_ratio else None,
    )  # (B,), (B,)
    adv_seq, n_tok_seq = _sequence_advantage(advantages, mask)  # (B,), (B,)
    # A = 0 rows take the positive kernel; their loss is zero either way.
    positive_seq = adv_seq >= 0  # (B,)
    phi_seq = spec.phi(log_w_seq, positive_seq, config)  # (B,)
    loss_tok = kernel_loss_tok(log_prob, phi_seq, advantages, mask)  # (B, T)
    return KernelTerms(loss_tok, mask, log_w_seq, clamped_seq, phi_seq, adv_seq, n_tok_seq, counts)


def respo_terms(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: ReSPOConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> KernelTerms:
    """ReSPO per-token loss and per-sequence terms for one micro-batch (all tensors (B, T)).

    The computation runs in fp32 (fp64 if any input is fp64). Non-finite inputs are counted, not raised here, so
    that a caller can fold the check into its single host synchronisation; :func:`raise_on_nonfinite` raises.
    """
    return _kernel_terms(
        KERNELS["respo"], log_prob, old_log_prob, advantages, response_mask, config, rollout_is_weights
    )


def vespo_terms(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: VESPOConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> KernelTerms:
    """VESPO counterpart of :func:`respo_terms` (token log-ratios clamped before summing, as VESPO does)."""
    return _kernel_terms(
        KERNELS["vespo"], log_prob, old_log_prob, advantages, response_mask, config, rollout_is_weights
    )


def kernel_terms(
    loss_name: str,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: ReSPOConfig | VESPOConfig | HybridConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> KernelTerms:
    """The terms of any kernel of :data:`KERNELS` by its loss name (the ablation kernels among them).

    ``config`` must be the kernel's config class (:class:`KernelSpec`); shapes and checks as :func:`respo_terms`.
    """
    try:
        spec = KERNELS[loss_name]
    except KeyError:
        raise ValueError(f"unknown kernel {loss_name!r}; choose from {', '.join(KERNELS)}") from None
    return _kernel_terms(spec, log_prob, old_log_prob, advantages, response_mask, config, rollout_is_weights)
