"""verl-facing adapter of the miniature (``python -m experiments.mini``), which runs the update step outside verl's
trainer.

Everything an experiment needs from verl, and nothing else: the actor dataclass composed from one of our algorithm
presets (``algorithm=grpo|gspo|vespo|respo`` of ``respo_trainer``, exactly as the trainer builds it), the policy loss
that preset selects from verl's registry, called with the keywords of ``verl.workers.utils.losses.ppo_loss``, the
global batch information the engine sets before that call, and the advantages from verl's own
``compute_advantage`` with the preset's estimator. No loss or advantage is re-implemented here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from respo_verl import algorithms
from respo_verl.run.compose import CPU_COMPOSE_OVERRIDES, compose_job


@dataclass
class AlgorithmSetup:
    """One algorithm preset, resolved the way verl resolves it.

    Attributes:
        name: the preset, one of :data:`respo_verl.algorithms.ALGORITHMS`.
        loss_mode: ``actor.policy_loss.loss_mode`` of the preset (``vanilla`` for ``grpo``).
        actor_config: verl's actor dataclass (``FSDPActorConfig``) built from the composed config.
        algorithm_config: the composed ``algorithm`` node (OmegaConf), as the trainer passes it to the estimator.
        policy_loss_fn: ``verl.trainer.ppo.core_algos.get_policy_loss_fn(loss_mode)``.
    """

    name: str
    loss_mode: str
    actor_config: Any
    algorithm_config: Any
    policy_loss_fn: Any

    @property
    def adv_estimator(self) -> str:
        return str(self.algorithm_config.adv_estimator)

    @property
    def loss_agg_mode(self) -> str:
        return str(self.actor_config.loss_agg_mode)


def load_algorithm(name: str, overrides: Sequence[str] = ()) -> AlgorithmSetup:
    """Compose ``respo_trainer`` with ``algorithm=<name>`` and resolve its actor config and policy loss.

    Args:
        name: one of :data:`respo_verl.algorithms.ALGORITHMS`.
        overrides: further Hydra overrides (e.g. ``actor_rollout_ref.actor.policy_loss.respo.lambda_pos=1``).

    Raises:
        ValueError: for an unknown preset; :class:`respo_verl.run.compose.ComposeError` for overrides Hydra rejects.
    """
    algorithms.get(name)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    import respo_verl.verl.plugin  # noqa: F401  (registers respo/vespo where the entry point was not loaded)

    cfg = compose_job("respo", [f"algorithm={name}", *CPU_COMPOSE_OVERRIDES, *overrides])
    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    loss_mode = actor_config.policy_loss.get("loss_mode", "vanilla")
    return AlgorithmSetup(name, loss_mode, actor_config, cfg.algorithm, get_policy_loss_fn(loss_mode))


def set_global_batch_info(actor_config: Any, batch_num_tokens: int, global_batch_size: int) -> None:
    """Set ``config.global_batch_info`` as verl's ``ppo_loss`` does before calling the loss (one rank).

    Args:
        actor_config: the actor dataclass of :class:`AlgorithmSetup`.
        batch_num_tokens: valid response tokens of the whole mini-batch.
        global_batch_size: responses in the mini-batch.
    """
    actor_config.global_batch_info["dp_size"] = 1
    actor_config.global_batch_info["batch_num_tokens"] = int(batch_num_tokens)
    actor_config.global_batch_info["global_batch_size"] = int(global_batch_size)
    actor_config.global_batch_info["loss_scale_factor"] = actor_config.loss_scale_factor


def policy_loss(
    setup: AlgorithmSetup,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Call the preset's registered loss exactly as ``ppo_loss`` calls it (by keyword, whole actor config).

    Entropy coefficient and KL loss are 0/off in every preset, so ``ppo_loss``'s total equals this ``pg_loss``.

    Args:
        old_log_prob, log_prob, advantages: (B, T); ``log_prob`` carries the gradient.
        response_mask: (B, T) bool.

    Returns:
        ``(pg_loss, metrics)`` with tensor-valued metrics turned into floats.
    """
    pg_loss, metrics = setup.policy_loss_fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=setup.actor_config.loss_agg_mode,
        config=setup.actor_config,
        rollout_is_weights=None,
    )
    out = {}
    for key, value in metrics.items():
        out[key] = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
    return pg_loss, out


def compute_advantages(
    setup: AlgorithmSetup, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[Any]
) -> torch.Tensor:
    """Advantages from verl's ``ray_trainer.compute_advantage`` with the preset's estimator (GRPO family).

    Args:
        token_level_rewards: (B, T) outcome reward on the last valid token.
        response_mask: (B, T) bool.
        uids: B prompt group ids (verl's ``non_tensor_batch['uid']``).

    Returns:
        (B, T) advantages, 0 on masked tokens.
    """
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    data = DataProto.from_dict(
        tensors={"token_level_rewards": token_level_rewards, "response_mask": response_mask},
        non_tensors={"uid": np.asarray(list(uids), dtype=object)},
    )
    data = compute_advantage(
        data,
        adv_estimator=setup.adv_estimator,
        norm_adv_by_std_in_grpo=bool(setup.algorithm_config.get("norm_adv_by_std_in_grpo", True)),
        config=setup.algorithm_config,
    )
    return data.batch["advantages"]
