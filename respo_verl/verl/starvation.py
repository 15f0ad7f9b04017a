"""One starved-mass measure for every policy loss in verl's trainer: ReSPO, VESPO, GRPO (verl's ``vanilla``), GSPO.

Each loss of :data:`MEASURED_LOSSES` in verl's policy-loss registry is wrapped so that, on every call that trains
(``log_prob`` carries a gradient), it also returns ``actor/starved_mass_share``
(:data:`respo_verl.core.diagnostics.INDEPENDENT_STARVED_MASS_KEY`): the share of the gradient mass held by positive
responses with log W < −1, with φ the effective coefficient the loss gave each sequence, read from
∂pg_loss/∂log π_θ (:func:`respo_verl.core.diagnostics.effective_terms`; the miniature's measure, docs/method.md,
"Diagnostics"). The wrapped loss, its value and its gradient are unchanged. The gradient is taken with
``torch.autograd.grad`` down to ``log_prob`` only, so it runs through the loss's element-wise operations and never
through the model.

Our kernel losses also log their own measure under ``actor/<loss>/starved_mass_share`` (φ the kernel's); the two
agree for them (a test checks it), and the report keeps them in separate columns.

Registered again under the same names through verl's ``register_policy_loss``, with a ``Patch`` for the version
guard and the undo. Applied by the plugin in every process; ``RESPO_VERL_STARVED_MASS=0`` in the workers' environment
leaves the registry as it is (the step benchmark's baseline, ``scripts/bench/cpu_step.py --measure``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

from respo_verl.core.diagnostics import INDEPENDENT_STARVED_MASS_KEY, effective_terms, starved_mass_share
from respo_verl.core.losses import KERNELS
from respo_verl.patches import Patch

MEASURED_LOSSES = ("vanilla", "gspo", *KERNELS)
SWITCH_ENV = "RESPO_VERL_STARVED_MASS"


def measured(loss_fn: Callable) -> Callable:
    """``loss_fn`` (verl's policy-loss signature) with :data:`INDEPENDENT_STARVED_MASS_KEY` added to its metrics."""

    @functools.wraps(loss_fn)
    def compute_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        pg_loss, metrics = loss_fn(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            config=config,
            rollout_is_weights=rollout_is_weights,
            **kwargs,
        )
        if torch.is_grad_enabled() and log_prob.requires_grad and pg_loss.requires_grad:
            kept = log_prob.grad if log_prob.retains_grad else None  # retain_grad's hook fires here too
            (grad,) = torch.autograd.grad(pg_loss, log_prob, retain_graph=True)  # (B, T)
            if log_prob.retains_grad:
                log_prob.grad = kept
            terms = effective_terms(log_prob.detach(), grad, old_log_prob, advantages, response_mask)
            # A 0-dim tensor: verl reads metrics once per step, so the call adds no host synchronisation.
            metrics = {**metrics, INDEPENDENT_STARVED_MASS_KEY: starved_mass_share(terms)}
        return pg_loss, metrics

    compute_policy_loss.unmeasured = loss_fn  # the loss as it was registered before
    return compute_policy_loss


def _install(patch: Patch) -> None:
    for name in MEASURED_LOSSES:
        loss_fn = POLICY_LOSS_REGISTRY.get(name)
        if loss_fn is None or hasattr(loss_fn, "unmeasured"):
            continue
        register_policy_loss(name)(measured(loss_fn))  # verl's registry takes a name again, and keeps the last
        patch.on_remove(
            functools.partial(register_policy_loss(name), loss_fn),
            where=f"POLICY_LOSS_REGISTRY[{name!r}]",
            why=f"adds {INDEPENDENT_STARVED_MASS_KEY} to the loss's metrics; the loss itself is unchanged",
        )


MEASURE = Patch("starved mass share of every policy loss", "verl", "0.9.1", _install)


def apply_unless_switched_off() -> bool:
    """Apply :data:`MEASURE` unless ``RESPO_VERL_STARVED_MASS=0``; True when it is applied now."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return False
    return MEASURE.apply()
