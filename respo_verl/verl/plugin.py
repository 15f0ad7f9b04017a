"""Registers respo-verl in verl: the ``respo``/``vespo`` policy losses, the ``respo`` advantage estimator, the
route-drift Megatron engines, the respo-verl trainer (``trainer.v1.trainer_mode=respo_sync``) and the presets'
OmegaConf resolvers. Registrations only, through verl's and OmegaConf's public registries; no patch.

Loaded three ways, so that every process of a run has the registrations:

- the ``verl.plugins`` entry point (``import verl`` loads it in the driver, the TaskRunner and every worker);
- ``VERL_USE_EXTERNAL_MODULES=respo_verl.verl.plugin``, which the algorithm presets put into Ray's runtime env:
  verl imports it on ``import verl`` in every Ray process and raises if it cannot, so a node without this package
  stops the run at start-up rather than at the first update;
- building :class:`respo_verl.verl.config.ReSPOPolicyLossConfig` (the ``_target_`` of the presets' ``policy_loss``).

verl swallows entry-point failures at DEBUG level; :func:`require_policy_loss` is the loud check.

The route-drift engines (:mod:`respo_verl.routing.engine`) are registered when verl itself imports its Megatron
engine module, so a process that never builds an engine (the driver, the TaskRunner, the rollout servers) imports
nothing of Megatron here; the ``routing=r2|r3`` presets select them with verl's ``VERL_ENGINE_VENDOR``.
"""

from __future__ import annotations

from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

from respo_verl.entry_points import INSTALL_HINT
from respo_verl.routing.engine import REGISTRATION as ROUTE_DRIFT_ENGINES
from respo_verl.verl import advantage as _advantage  # noqa: F401  (registers "respo" estimator)
from respo_verl.verl import losses as _losses  # noqa: F401  (registers the POLICY_LOSSES)
from respo_verl.verl import resolvers
from respo_verl.verl.trainer import REGISTRATION as TRAINER

POLICY_LOSSES = ("respo", "vespo", "respo_pos", "respo_neg", "phi_one")
ADVANTAGE_ESTIMATORS = ("respo",)
ROUTE_DRIFT_ENGINES.apply()
TRAINER.apply()
resolvers.register()


def require_policy_loss(loss_mode: str) -> None:
    """Raise unless ``loss_mode`` is registered in verl's policy-loss registry."""
    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"policy_loss.loss_mode={loss_mode!r} is not registered in verl "
            f"(registered: {sorted(POLICY_LOSS_REGISTRY)}); {INSTALL_HINT}"
        )


def registered() -> dict[str, bool]:
    """Which of our names are visible in verl's registries in this process."""
    status = {f"policy_loss/{name}": name in POLICY_LOSS_REGISTRY for name in POLICY_LOSSES}
    status.update({f"adv_estimator/{name}": name in ADV_ESTIMATOR_REGISTRY for name in ADVANTAGE_ESTIMATORS})
    status["engine/route_drift"] = ROUTE_DRIFT_ENGINES.applied
    status["trainer/respo_sync"] = TRAINER.applied
    return status
