"""Registers respo-verl in verl: the ``respo``/``vespo`` policy losses, the ``respo`` advantage estimator, the
route-drift Megatron engines, the respo-verl trainer (``trainer.v1.trainer_mode=respo_sync``) and the presets'
OmegaConf resolvers, through verl's and OmegaConf's public registries; then wraps every policy loss so that it also
logs the method-independent starved mass share (:mod:`respo_verl.verl.starvation`, a ``Patch`` of verl's registry),
and gives the run a TransferQueue controller of its own (:mod:`respo_verl.patches.transfer_queue_0_1_11`), so that
runs sharing a Ray cluster keep their queues apart.

Loaded three ways, so that every process of a run has the registrations:

- the ``verl.plugins`` entry point (``import verl`` loads it in the driver, the TaskRunner and every worker);
- ``VERL_USE_EXTERNAL_MODULES=respo_verl.verl.plugin``, which the algorithm presets put into Ray's runtime env:
  verl imports it on ``import verl`` in every Ray process and raises if it cannot, so a node without this package
  stops the run at start-up rather than at the first update;
- building :class:`respo_verl.verl.config.ReSPOPolicyLossConfig` (the ``_target_`` of the presets' ``policy_loss``).

verl swallows entry-point failures at DEBUG level; :func:`respo_verl.verl.config.require_policy_loss` is the
loud check.

The route-drift engines (:mod:`respo_verl.routing.engine`) are registered when verl itself imports its Megatron
engine module, so a process that never builds an engine (the driver, the TaskRunner, the rollout servers) imports
nothing of Megatron here; the ``routing=r2|r3`` presets select them with verl's ``VERL_ENGINE_VENDOR``.
"""

from __future__ import annotations

from respo_verl.patches.transfer_queue_0_1_11 import PER_RUN_CONTROLLER as TRANSFER_QUEUE_OF_THE_RUN
from respo_verl.routing.engine import REGISTRATION as ROUTE_DRIFT_ENGINES
from respo_verl.run import resolvers
from respo_verl.run.trainer import REGISTRATION as TRAINER
from respo_verl.verl import advantage as _advantage  # noqa: F401  (registers the "respo" estimator)
from respo_verl.verl import losses as _losses  # noqa: F401  (registers a loss per kernel of core.losses.KERNELS)
from respo_verl.verl import starvation

ROUTE_DRIFT_ENGINES.apply()
TRAINER.apply()
resolvers.register()
starvation.apply_unless_switched_off()  # after the losses: wraps them, and verl's vanilla and gspo
TRANSFER_QUEUE_OF_THE_RUN.apply()  # before any TransferQueue actor is named: runs sharing a cluster stay apart
