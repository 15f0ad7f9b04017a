"""Registers the ``respo``/``vespo`` policy losses and the ``respo`` advantage estimator in verl.

Loaded three ways, so that every process of a run has the registrations:

- the ``verl.plugins`` entry point (``import verl`` loads it in the driver, the TaskRunner and every worker);
- ``VERL_USE_EXTERNAL_MODULES=respo_verl.verl.plugin``, which the algorithm presets put into Ray's runtime env:
  verl imports it on ``import verl`` in every Ray process and raises if it cannot, so a node without this package
  stops the run at start-up rather than at the first update;
- building :class:`respo_verl.verl.config.ReSPOPolicyLossConfig` (the ``_target_`` of the presets' ``policy_loss``).

verl swallows entry-point failures at DEBUG level; :func:`require_policy_loss` is the loud check.

With ``RESPO_VERL_ROUTING_DIAGNOSTICS=1`` in the environment (the ``routing=r2``/``r3`` presets put it into Ray's
runtime env) it also applies :mod:`respo_verl.verl.patches.verl_0_9_1_megatron_routing_metrics`, and with
``VERL_PLATFORM=cpu`` (the ``device=cpu`` preset) it imports :mod:`respo_verl.verl.cpu`; otherwise nothing.
"""

from __future__ import annotations

import os

from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

from respo_verl.verl import advantage as _advantage  # noqa: F401  (registers "respo" estimator)
from respo_verl.verl import losses as _losses  # noqa: F401  (registers "respo", "vespo" losses)
from respo_verl.verl.patches import verl_0_9_1_megatron_routing_metrics as _routing_metrics

POLICY_LOSSES = ("respo", "vespo")
ADVANTAGE_ESTIMATORS = ("respo",)
INSTALL_HINT = (
    "install respo-verl in the Python environment of every node that runs verl (pip install respo-verl), "
    "or select a loss that verl ships"
)
# Route-drift metrics from verl's Megatron engine: patched only when the environment switches them on.
ROUTING_METRICS_PATCHED = _routing_metrics.maybe_apply()
# verl on CPU, switched on by the environment like the routing metrics: the device=cpu preset sets VERL_PLATFORM=cpu in
# Ray's runtime env, and a user of verl's own entry point sets it in the shell for the driver.
CPU_ENABLED = os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"
if CPU_ENABLED:
    from respo_verl.verl import cpu as _cpu  # noqa: F401  (applies the CPU platform, gloo default, hf_cpu rollout)


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
    return status
