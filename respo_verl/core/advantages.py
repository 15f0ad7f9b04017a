"""Group-relative outcome advantage (GRPO; docs/method.md, "Advantages") with the per-sequence view the kernels need."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

# verl's GRPO epsilon: keeps a group whose rewards are all equal (std 0) at advantage 0 instead of 0/0.
GRPO_EPSILON = 1e-6
# The name the estimator is registered under in verl (algorithm.adv_estimator=respo).
ESTIMATOR = "respo"


@dataclass
class GroupAdvantage:
    """Result of :func:`group_relative_advantage`.

    Attributes:
        adv_seq: (B,) one scalar advantage per response; the kernel's branch is its sign.
        adv_tok: (B, T) ``adv_seq`` broadcast over the response tokens, 0 on masked tokens.
        n_pos, n_neg, n_zero: responses with A > 0, A < 0, A = 0 (the last carry no gradient).
        n_groups: prompt groups in the batch.
        n_flat_groups: groups of more than one response whose rewards are all equal (no learning signal).
    """

    adv_seq: torch.Tensor
    adv_tok: torch.Tensor
    n_pos: int
    n_neg: int
    n_zero: int
    n_groups: int
    n_flat_groups: int


def group_relative_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    norm_adv_by_std: bool = True,
    epsilon: float = GRPO_EPSILON,
) -> GroupAdvantage:
    """A_i = (R_i − mean_g R) / (std_g R + ε), or R_i − mean_g R without std normalisation.

    R_i is the sum of the token-level rewards of response i; std is the unbiased standard deviation; a group of
    one response gets mean 0 and std 1. The arithmetic is done per group in the same order as verl's ``grpo``
    estimator, so the two agree bit for bit.

    Args:
        token_level_rewards: (B, T) rewards (outcome reward on the last valid token).
        response_mask: (B, T) valid response tokens.
        index: B group ids (verl's ``uid``: one per prompt, shared by its n responses).
        norm_adv_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        epsilon: added to the std.

    Raises:
        ValueError: on a length mismatch between ``index`` and the batch, or non-finite rewards.
    """
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be (batch, response_length)"
        )
    batch = token_level_rewards.shape[0]
    if len(index) != batch:
        raise ValueError(f"index has {len(index)} group ids for a batch of {batch} responses")
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # (B,)
        n_bad = int((~torch.isfinite(scores)).sum())
        if n_bad:
            raise ValueError(f"token_level_rewards holds non-finite values in {n_bad} of {batch} responses")
        groups: dict[Hashable, list[int]] = {}
        for i, uid in enumerate(index):
            groups.setdefault(uid, []).append(i)
        mean_seq = torch.empty_like(scores)  # (B,)
        std_seq = torch.empty_like(scores)  # (B,)
        n_flat = 0
        for members in groups.values():
            rows = torch.tensor(members, device=scores.device)
            if len(members) == 1:
                mean_seq[rows], std_seq[rows] = 0.0, 1.0
                continue
            group_scores = scores[rows]
            mean_seq[rows] = torch.mean(group_scores)
            std_seq[rows] = torch.std(group_scores)
            n_flat += bool((group_scores == group_scores[0]).all())
        adv_seq = (scores - mean_seq) / (std_seq + epsilon) if norm_adv_by_std else scores - mean_seq  # (B,)
        adv_tok = adv_seq.unsqueeze(-1) * response_mask  # (B, T)
        n_pos, n_neg = int((adv_seq > 0).sum()), int((adv_seq < 0).sum())
    return GroupAdvantage(adv_seq, adv_tok, n_pos, n_neg, batch - n_pos - n_neg, len(groups), n_flat)
