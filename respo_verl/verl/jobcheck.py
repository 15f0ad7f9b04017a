"""Checks of a composed job that would otherwise fail late, or in words that do not say what to change.

:func:`check_job` runs on the composed configuration (an OmegaConf node), before anything is printed or launched:
by the entry point (for a run and for ``--cfg job``), the planner and ``respo-verl sweep``. It imports neither verl
nor Hydra, so calling it costs no start-up time beyond the kernel configuration classes.
"""

from __future__ import annotations

from typing import Any

POLICY_LOSS = "actor_rollout_ref.actor.policy_loss"
# Kernel hyperparameter nodes of the respo / vespo presets -> their config class in respo_verl.core.config.
KERNEL_NODES = {"respo": "ReSPOConfig", "vespo": "VESPOConfig"}
ROUTER_REPLAY_MODE = "actor_rollout_ref.actor.megatron.router_replay.mode"
ROUTING_ENGINE = "megatron"  # verl 0.9.1 replays routes on its Megatron engine only


def check_job(cfg: Any) -> None:
    """Raise ValueError with one line naming the key for a job that cannot run.

    Checks:
        - the ``respo`` / ``vespo`` kernel hyperparameters (``actor_rollout_ref.actor.policy_loss.<loss>.*``), with
          the ranges of :mod:`respo_verl.core.config`, when the node is present;
        - routing replay (``routing=r2|r3``: the actor's ``megatron.router_replay.mode`` is not ``disabled``) with
          a ``model_engine`` other than ``megatron``.

    Args:
        cfg: the composed job (``DictConfig``), as ``--cfg job`` prints it.
    """
    _check_kernel_hyperparameters(cfg)
    _check_routing(cfg)


def _check_kernel_hyperparameters(cfg: Any) -> None:
    from omegaconf import OmegaConf

    from respo_verl.core import config as kernel_config

    for loss, class_name in KERNEL_NODES.items():
        path = f"{POLICY_LOSS}.{loss}"
        node = OmegaConf.select(cfg, path, default=None)
        if node is None:
            continue
        try:
            values = OmegaConf.to_container(node, resolve=True)
        except Exception as exc:  # an interpolation that does not resolve
            raise ValueError(f"{path}: {exc}".splitlines()[0]) from None
        if not isinstance(values, dict):
            raise ValueError(f"{path} must be a mapping of kernel hyperparameters, got {values!r}")
        values.pop("_target_", None)
        cls = getattr(kernel_config, class_name)
        try:
            cls(**values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None


def _check_routing(cfg: Any) -> None:
    from omegaconf import OmegaConf

    mode = OmegaConf.select(cfg, ROUTER_REPLAY_MODE, default=None)
    engine = OmegaConf.select(cfg, "model_engine", default=None)
    if mode is None or str(mode).lower() == "disabled" or engine == ROUTING_ENGINE:
        return
    raise ValueError(
        f"routing replay needs model_engine={ROUTING_ENGINE}, got model_engine={engine} "
        f"with {ROUTER_REPLAY_MODE}={mode}"
    )
