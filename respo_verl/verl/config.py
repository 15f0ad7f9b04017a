"""verl config class that carries the kernel hyperparameters.

verl has no free-form hyperparameter dict on the policy loss, so the presets point
``actor_rollout_ref.actor.policy_loss._target_`` at :class:`ReSPOPolicyLossConfig`. Hydra instantiates it in the
driver (inside ``validate_config``) and in every worker; the loss then reads ``config.policy_loss.respo`` or
``config.policy_loss.vespo``. Defaults and validation live in :mod:`respo_verl.core.config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import PolicyLossConfig

from respo_verl.core.config import CONFIG_BLOCKS, ReSPOConfig, VESPOConfig
from respo_verl.entry_points import INSTALL_HINT


def require_policy_loss(loss_mode: str) -> None:
    """Raise ValueError unless ``loss_mode`` is registered in verl's policy-loss registry in this process (the
    plugin registers ours when verl is imported; a missing registration means the package or its plugin is not
    installed where verl runs)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"policy_loss.loss_mode={loss_mode!r} is not registered in verl "
            f"(registered: {sorted(POLICY_LOSS_REGISTRY)}); {INSTALL_HINT}"
        )


def _as_kernel_config(value: Any, cls: type, key: str) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return cls(**{k: v for k, v in value.items() if k != "_target_"})
    raise TypeError(f"policy_loss.{key} must be a mapping of {cls.__name__} fields, got {type(value).__name__}")


@dataclass
class ReSPOPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the ReSPO and VESPO kernel hyperparameters.

    Building it also registers the ``respo``/``vespo`` losses (``__post_init__`` imports the plugin) and checks
    that ``loss_mode`` names a registered loss, so a misspelt or missing loss fails when the config is built, in the
    driver, before Ray starts.

    Args:
        respo: :class:`respo_verl.core.config.ReSPOConfig` (``policy_loss.respo.*`` on the command line).
        vespo: :class:`respo_verl.core.config.VESPOConfig` (``policy_loss.vespo.*``).
    """

    respo: ReSPOConfig = field(default_factory=ReSPOConfig)
    vespo: VESPOConfig = field(default_factory=VESPOConfig)

    def __post_init__(self) -> None:
        # BaseConfig freezes assigned fields; normalising a mapping into the dataclass is part of construction.
        for block, cls in CONFIG_BLOCKS.items():  # a field per block (tests/verl/test_configs.py checks)
            object.__setattr__(self, block, _as_kernel_config(getattr(self, block), cls, block))
        from respo_verl.verl import plugin  # noqa: F401  (registers the losses in this process)

        require_policy_loss(self.loss_mode)
