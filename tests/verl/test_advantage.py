"""The `respo` advantage estimator through verl's own compute_advantage, against verl's `grpo`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CPU_COMPOSE_OVERRIDES, compose
from verl import DataProto
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.ray_trainer import compute_advantage


def rollout_batch(seed: int, groups: int = 6, n: int = 8, length: int = 12) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    batch = groups * n
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), lengths - 1] = torch.where(torch.rand(batch, generator=g) < 0.3, 1.0, -1.0)
    uid = np.array([f"prompt-{i // n}" for i in range(batch)], dtype=object)
    uid[-1] = "a-group-of-one"
    return DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask}, non_tensors={"uid": uid}
    )


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_respo_estimator_equals_verls_grpo_exactly(norm_by_std, seed):
    cfg = compose(["algorithm=respo", *CPU_COMPOSE_OVERRIDES, f"algorithm.norm_adv_by_std_in_grpo={norm_by_std}"])
    assert cfg.algorithm.adv_estimator == "respo"
    ours = compute_advantage(
        rollout_batch(seed), adv_estimator="respo", norm_adv_by_std_in_grpo=norm_by_std, config=cfg.algorithm
    )
    grpo = compute_advantage(
        rollout_batch(seed), adv_estimator="grpo", norm_adv_by_std_in_grpo=norm_by_std, config=cfg.algorithm
    )
    assert torch.equal(ours.batch["advantages"], grpo.batch["advantages"])
    assert torch.equal(ours.batch["returns"], grpo.batch["returns"])
    # One scalar per response: constant over its valid tokens, zero on padding.
    adv, mask = ours.batch["advantages"], ours.batch["response_mask"].bool()
    first = adv[:, :1].expand_as(adv)
    assert torch.equal(torch.where(mask, adv, first), first)
    assert (adv[~mask] == 0).all()


def test_respo_estimator_requires_group_ids():
    data = rollout_batch(0)
    fn = get_adv_estimator_fn("respo")
    with pytest.raises(ValueError, match="uid"):
        fn(token_level_rewards=data.batch["token_level_rewards"], response_mask=data.batch["response_mask"])


def test_respo_estimator_rejects_non_finite_rewards():
    data = rollout_batch(0)
    rewards = data.batch["token_level_rewards"].clone()
    rewards[3, 0] = float("nan")
    fn = get_adv_estimator_fn("respo")
    with pytest.raises(ValueError, match="non-finite values in 1 of 48 responses"):
        fn(token_level_rewards=rewards, response_mask=data.batch["response_mask"], index=data.non_tensor_batch["uid"])


def test_the_epsilon_default_is_the_core_constant():
    import inspect

    from respo_verl.core.advantages import GRPO_EPSILON
    from respo_verl.verl.advantage import compute_respo_outcome_advantage

    assert inspect.signature(compute_respo_outcome_advantage).parameters["epsilon"].default is GRPO_EPSILON
