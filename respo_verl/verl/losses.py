"""The ``respo`` and ``vespo`` policy losses, registered in verl's policy-loss registry.

verl's ``ppo_loss`` (every engine: FSDP, Megatron, ...) calls them by keyword with padded (B, T) tensors and the
whole actor config. They normalise only through verl's ``agg_loss`` with ``config.global_batch_info``, so the
gradient does not depend on micro-batching or the data-parallel size. Entropy and KL terms are added by ``ppo_loss``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from respo_verl.core import diagnostic_keys, kernel_diagnostics, raise_on_nonfinite, respo_terms, vespo_terms
from respo_verl.core.config import ReSPOConfig, VESPOConfig
from respo_verl.core.losses import KernelTerms

METRIC_PREFIX = {"respo": "actor/respo/", "vespo": "actor/vespo/"}
# When set (in the workers' environment, e.g. through Ray's runtime env), every call appends its sequences' log W, φ,
# advantage and token count to this JSON-lines file (suffixed with the process's RANK): the demo's figure of the φ
# each stale positive received. One extra host copy per call; off by default.
TRACE_ENV = "RESPO_VERL_KERNEL_TRACE"


def _kernel_config(config: Any, loss_name: str) -> ReSPOConfig | VESPOConfig:
    expected = ReSPOConfig if loss_name == "respo" else VESPOConfig
    policy_loss = getattr(config, "policy_loss", None) if config is not None else None
    kernel_config = getattr(policy_loss, loss_name, None)
    if not isinstance(kernel_config, expected):
        raise TypeError(
            f"loss_mode={loss_name!r} needs actor_rollout_ref.actor.policy_loss._target_="
            f"respo_verl.verl.config.ReSPOPolicyLossConfig (set by +algorithm={loss_name}); got policy_loss of type "
            f"{type(policy_loss).__name__}"
        )
    return kernel_config


def _global_batch_info(config: Any, mask: torch.Tensor) -> dict[str, Any]:
    info = dict(getattr(config, "global_batch_info", None) or {})
    if (info.get("dp_size") or 1) <= 1:
        # Without global batch info agg_loss normalises by this micro-batch's own counts, which are 0 for a fully
        # masked micro-batch (0/0). Its sum is 0 whatever the divisor, so clamping the count at 1 keeps it finite
        # and changes nothing else. With dp_size > 1 missing info stays an error inside agg_loss.
        if info.get("batch_num_tokens") is None:
            info["batch_num_tokens"] = mask.sum().clamp(min=1)
        if info.get("global_batch_size") is None:
            info["global_batch_size"] = (mask.sum(dim=-1) > 0).sum().clamp(min=1)
    return info


def _finish(
    loss_name: str, terms: KernelTerms, loss_agg_mode: str, config: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    mask = terms.response_mask
    pg_loss = agg_loss(terms.loss_tok, mask, loss_agg_mode, **_global_batch_info(config, mask))
    diagnostics = kernel_diagnostics(terms)  # (K,)
    n_valid_tok = mask.sum().to(diagnostics.dtype).reshape(1)
    # The one host synchronisation of the call: the non-finite check and every metric in one transfer.
    values = torch.cat([terms.nonfinite_counts.to(diagnostics.dtype), n_valid_tok, diagnostics]).tolist()
    raise_on_nonfinite(values[:3], values[3], loss_name)
    if os.environ.get(TRACE_ENV):
        _trace(os.environ[TRACE_ENV], loss_name, terms)
    prefix = METRIC_PREFIX[loss_name]
    return pg_loss, {prefix + key: value for key, value in zip(diagnostic_keys(), values[4:], strict=True)}


def _trace(path: str, loss_name: str, terms: KernelTerms) -> None:
    valid = terms.n_tok_seq > 0
    row = {
        "loss": loss_name,
        **{
            key: tensor[valid].tolist()
            for key, tensor in (
                ("log_w", terms.log_w_seq),
                ("phi", terms.phi_seq),
                ("adv", terms.adv_seq),
                ("n_tok", terms.n_tok_seq),
            )
        },
    }
    with open(f"{path}.rank{os.environ.get('RANK', '0')}", "a") as out:
        out.write(json.dumps(row) + "\n")


@register_policy_loss("respo")
def compute_policy_loss_respo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ReSPO policy loss (arXiv 2609.35433): ℓ_it = −sg[φ(W_i)]·A_it·log π_θ(o_it), aggregated by ``agg_loss``.

    φ is the two-branch ReSPO kernel (``docs/method.md, "ReSPO kernels"``) of the clamped sequence weight W_i, chosen
    by the sign of the sequence advantage; hyperparameters come from ``config.policy_loss.respo``.

    Args:
        old_log_prob, log_prob, advantages: (B, T); ``log_prob`` carries the gradient.
        response_mask: (B, T) bool.
        loss_agg_mode: any mode of verl's ``agg_loss``.
        config: the actor config (``FSDPActorConfig``, ``McoreActorConfig``, ...).
        rollout_is_weights: optional (B, T) rollout-correction weights, folded into log W.

    Returns:
        ``(pg_loss, metrics)`` with the diagnostics of ``docs/method.md, "Diagnostics"`` under ``actor/respo/``.
    """
    terms = respo_terms(
        log_prob, old_log_prob, advantages, response_mask, _kernel_config(config, "respo"), rollout_is_weights
    )
    return _finish("respo", terms, loss_agg_mode, config)


@register_policy_loss("vespo")
def compute_policy_loss_vespo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """VESPO policy loss (arXiv 2602.10693), the baseline: φ(W) = W^k·exp(λ(1−W)) per branch.

    Same form, shapes and metrics as :func:`compute_policy_loss_respo`, under ``actor/vespo/``; hyperparameters
    from ``config.policy_loss.vespo``.
    """
    terms = vespo_terms(
        log_prob, old_log_prob, advantages, response_mask, _kernel_config(config, "vespo"), rollout_is_weights
    )
    return _finish("vespo", terms, loss_agg_mode, config)
