"""The ``respo`` advantage estimator: verl's GRPO outcome advantage, one exact scalar per response."""

from __future__ import annotations

import logging
from typing import Any

import torch
from verl.trainer.ppo.core_algos import register_adv_est

from respo_verl.core import group_relative_advantage
from respo_verl.core.advantages import ESTIMATOR, GRPO_EPSILON

logger = logging.getLogger(__name__)


@register_adv_est(ESTIMATOR)
def compute_respo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    config: Any = None,
    epsilon: float = GRPO_EPSILON,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages (docs/method.md, "Advantages"), equal bit for bit to verl's ``grpo`` under the same settings.

    The advantage is constant over each response's tokens (the sequence kernels read one scalar per response
    and choose the branch by its sign). ``algorithm.norm_adv_by_std_in_grpo`` is honoured as in ``grpo``. The
    branch counts are logged at DEBUG level; the losses report the same split as ``actor/<loss>/{pos,neg}/frac``.

    Returns:
        ``(advantages, returns)``, both (B, T).

    Raises:
        ValueError: without group ids (``uid``), or with non-finite rewards.
    """
    if index is None:
        raise ValueError("the respo advantage estimator needs the prompt group ids (verl's non_tensor_batch['uid'])")
    norm_by_std = True if config is None else bool(config.get("norm_adv_by_std_in_grpo", True))
    adv = group_relative_advantage(token_level_rewards, response_mask, index, norm_by_std, epsilon)
    logger.debug(
        "respo advantages: %d positive, %d negative, %d zero responses; %d of %d groups without signal",
        adv.n_pos,
        adv.n_neg,
        adv.n_zero,
        adv.n_flat_groups,
        adv.n_groups,
    )
    return adv.adv_tok, adv.adv_tok
