"""A policy loss in verl's registry for every kernel of :data:`respo_verl.core.losses.KERNELS`: ``respo`` and
``vespo``, and the branch-ablation losses ``respo_pos``, ``respo_neg`` and ``phi_one``
(docs/method.md, "Branch ablation").

verl's ``ppo_loss`` (every engine: FSDP, Megatron, ...) calls them by keyword with padded (B, T) tensors and the
whole actor config. They normalise only through verl's ``agg_loss`` with ``config.global_batch_info``, so the
gradient does not depend on micro-batching or the data-parallel size. Entropy and KL terms are added by ``ppo_loss``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from respo_verl.core import diagnostic_keys, kernel_diagnostics, raise_on_nonfinite
from respo_verl.core.config import CONFIG_BLOCKS, ReSPOConfig, VESPOConfig
from respo_verl.core.kernels import HybridConfig
from respo_verl.core.losses import KERNELS, KernelTerms, kernel_terms

METRIC_PREFIX = {name: f"actor/{name}/" for name in KERNELS}
# When set (in the workers' environment, e.g. through Ray's runtime env), every call appends its sequences' log W, φ,
# advantage and token count to this JSON-lines file (suffixed with the process's RANK): the demo's figure of the φ
# each stale positive received. One extra host copy per call; off by default.
TRACE_ENV = "RESPO_VERL_KERNEL_TRACE"
# The value of TRACE_ENV that puts each run's trace beside its own verl file log (trace_path): one override shared by
# the runs of a sweep, one trace per run.
TRACE_BESIDE_LOG = "beside-log"
LOG_PATH_ENV = "VERL_FILE_LOGGER_PATH"  # verl's file log; respo_verl.main_ppo forwards it to the Ray workers


_ANNOUNCED: set[str] = set()  # losses whose paper-default fallback this process has announced


def _kernel_config(
    config: Any, loss_name: str, rollout_is_weights: torch.Tensor | None = None
) -> ReSPOConfig | VESPOConfig | HybridConfig:
    """The kernel config ``loss_name`` reads from ``config.policy_loss``: ``respo``/``vespo`` their own block, the
    hybrids both blocks (:class:`HybridConfig`), ``phi_one`` the ``respo`` block (its log W only).

    verl's own way of choosing a loss, ``actor_rollout_ref.actor.policy_loss.loss_mode=<name>`` without
    ``+algorithm=<name>``, leaves verl's ``PolicyLossConfig`` in place, which has no kernel blocks: the loss then
    trains with the paper's defaults (the dataclasses' defaults) and says so once per process (docs/method.md,
    "Configuration keys"). Except with rollout-IS weights: whether they are per token or per sequence is a key of the
    kernel block (``rollout_is_level``) that verl's config cannot carry, so that case raises, as does a
    ``policy_loss`` that does not select this loss at all.
    """
    policy_loss = getattr(config, "policy_loss", None) if config is not None else None
    blocks = KERNELS[loss_name].blocks
    found = [getattr(policy_loss, block, None) for block in blocks]
    fix = (
        f"actor_rollout_ref.actor.policy_loss._target_=respo_verl.verl.config.ReSPOPolicyLossConfig (set by "
        f"+algorithm={loss_name})"
    )
    if not all(isinstance(value, CONFIG_BLOCKS[block]) for block, value in zip(blocks, found)):
        selected = getattr(policy_loss, "loss_mode", None) == loss_name and not any(found)
        if not selected:
            got = type(policy_loss).__name__
            raise TypeError(f"loss_mode={loss_name!r} needs {fix}; got policy_loss of type {got}")
        if rollout_is_weights is not None:
            raise TypeError(
                f"loss_mode={loss_name!r} with rollout-IS weights needs {fix}: verl's PolicyLossConfig cannot say "
                f"whether they are per token or per sequence (policy_loss.{blocks[0]}.rollout_is_level)"
            )
        found = [CONFIG_BLOCKS[block]() for block in blocks]
        if loss_name not in _ANNOUNCED:
            _ANNOUNCED.add(loss_name)
            print(
                f"respo-verl: loss_mode={loss_name} with verl's PolicyLossConfig: the kernel uses the paper's "
                f"defaults, {', '.join(map(repr, found))}; to change them select {fix} and set "
                f"actor_rollout_ref.actor.policy_loss.<{'|'.join(blocks)}>.<field>",
                file=sys.stderr,
                flush=True,
            )
    return HybridConfig(*found) if len(found) == 2 else found[0]


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
        _trace(trace_path(os.environ), loss_name, terms)
    prefix = METRIC_PREFIX[loss_name]
    return pg_loss, {prefix + key: value for key, value in zip(diagnostic_keys(), values[4:], strict=True)}


def trace_path(environ: Mapping[str, str]) -> str:
    """Where the kernel trace goes (without the ``.rank<RANK>`` suffix), given the worker's environment: the path
    ``RESPO_VERL_KERNEL_TRACE`` names, or, for :data:`TRACE_BESIDE_LOG`, verl's file log ``$VERL_FILE_LOGGER_PATH``
    with its suffix replaced by ``.trace.jsonl`` (``logs/<run>.jsonl`` → ``logs/<run>.trace.jsonl``).

    Raises:
        ValueError: :data:`TRACE_BESIDE_LOG` without ``VERL_FILE_LOGGER_PATH`` (a log under
            ``VERL_FILE_LOGGER_ROOT`` has a path the loss cannot know).
    """
    value = environ[TRACE_ENV]
    if value != TRACE_BESIDE_LOG:
        return value
    log = environ.get(LOG_PATH_ENV)
    if not log:
        raise ValueError(
            f"{TRACE_ENV}={TRACE_BESIDE_LOG} puts the kernel trace beside verl's file log, but {LOG_PATH_ENV} is not "
            f"set in this worker: set it for the run (respo_verl.main_ppo forwards it to the workers), or give "
            f"{TRACE_ENV} a path"
        )
    return str(Path(log).with_suffix(".trace.jsonl"))


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


def _register(loss_name: str, doc: str):
    """Register the policy loss ``loss_name`` (a kernel of ``respo_verl.core.losses.KERNELS``) with verl.

    Every kernel loss has one form, ℓ_it = −sg[φ(W_i)]·A_it·log π_θ(o_it) aggregated by ``agg_loss``, verl's
    policy-loss signature, and its diagnostics (``docs/method.md, "Diagnostics"``) under ``actor/<loss_name>/``:

    Args:
        old_log_prob, log_prob, advantages: (B, T); ``log_prob`` carries the gradient.
        response_mask: (B, T) bool.
        loss_agg_mode: any mode of verl's ``agg_loss``.
        config: the actor config (``FSDPActorConfig``, ``McoreActorConfig``, ...).
        rollout_is_weights: optional (B, T) rollout-correction weights, folded into log W.

    Returns ``(pg_loss, metrics)``.
    """

    def compute_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        kernel_config = _kernel_config(config, loss_name, rollout_is_weights)
        terms = kernel_terms(
            loss_name, log_prob, old_log_prob, advantages, response_mask, kernel_config, rollout_is_weights
        )
        return _finish(loss_name, terms, loss_agg_mode, config)

    compute_policy_loss.__name__ = compute_policy_loss.__qualname__ = f"compute_policy_loss_{loss_name}"
    compute_policy_loss.__doc__ = doc + "\n\n" + "\n".join(_register.__doc__.splitlines()[2:])
    return register_policy_loss(loss_name)(compute_policy_loss)


# name -> the function registered in verl under that name.
REGISTERED = {name: _register(name, spec.doc) for name, spec in KERNELS.items()}
