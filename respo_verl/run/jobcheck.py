"""Checks of a composed job that would otherwise fail late, or in words that do not say what to change.

:func:`check_job` runs on the composed configuration (an OmegaConf node), before anything is printed or launched:
by the entry point (for a run and for ``--cfg job``), the planner and ``respo-verl sweep``. It imports neither verl
nor Hydra, so calling it costs no start-up time beyond the kernel configuration classes. Its layout check holds the
job to the planner's rules (:mod:`respo_verl.layout.rules`), which megatron-core, vLLM and verl would otherwise
enforce only after Ray has started and the model has loaded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from respo_verl.core.config import CONFIG_BLOCKS
from respo_verl.layout.rules import check_job_layout, reuse_of
from respo_verl.routing.mode import REPLAY_KEY, replay_mode, verl_mode
from respo_verl.run.guards import check_guards

POLICY_LOSS = "actor_rollout_ref.actor.policy_loss"
ROUTING_ENGINE = "megatron"  # verl 0.9.1 replays routes on its Megatron engine only
MODEL_PATH = "actor_rollout_ref.model.path"


class ModelCheckError(ValueError):
    """A model the run cannot load, in one line (:func:`check_model`)."""


def check_job(cfg: Any, layout: bool = True) -> None:
    """Raise ValueError with one line naming the key for a job (``cfg``, as ``--cfg job`` prints it) that cannot run;
    the layout rules only with ``layout`` (the planner applies them itself), the layout rule ``batch-mini`` always."""
    _check_kernel_hyperparameters(cfg)
    check_guards(cfg)
    _check_routing(cfg)
    _check_reuse(cfg)
    task_runner_resources(cfg)
    if layout and (violations := check_job_layout(cfg)):
        raise ValueError(
            f"layout: {len(violations)} rule(s) that megatron-core, vLLM or verl would enforce only after Ray starts: "
            + "; ".join(map(str, violations))
        )


def task_runner_resources(cfg: Any) -> dict[str, float]:
    """``ray_kwargs.task_runner_resources``: the Ray resources verl's TaskRunner asks for (a custom resource that one
    node was started with keeps it on that node); ValueError naming the key for anything but positive amounts."""
    resources = OmegaConf.select(cfg, "ray_kwargs.task_runner_resources", default=None)
    if resources is None:
        return {}
    if not OmegaConf.is_dict(resources) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in resources.values()
    ):
        raise ValueError(
            f"ray_kwargs.task_runner_resources={resources}: takes a map of Ray resource names to positive amounts, "
            "e.g. {trainer_node: 1}"
        )
    return {str(k): float(v) for k, v in resources.items()}


def check_model(cfg: Any) -> None:
    """Raise :class:`ModelCheckError` for ``actor_rollout_ref.model.path`` written as a local path (``/``, ``~`` or
    ``.`` first) that does not exist (a hub id is left to verl). It reads the file system, so the entry point runs it
    before a run and not for ``--cfg job``, which may be composed where the model is not."""
    raw = OmegaConf.select(cfg, MODEL_PATH, default=None)
    if raw is not None and str(raw).startswith(("/", "~", ".")) and not Path(str(raw)).expanduser().exists():
        raise ModelCheckError(f"{MODEL_PATH}={raw}: no such file or directory")


class MachineCheckError(ValueError):
    """A job this machine cannot run, in one line (:func:`check_machine`)."""


def check_machine(cfg: Any) -> None:
    """Raise :class:`MachineCheckError` for a ``trainer.device=cuda`` job that starts its own Ray on this machine (no
    ``ray_kwargs.ray_init.address`` and no ``RAY_ADDRESS``) where torch sees no CUDA device: Ray would wait for GPUs
    that never come. A job sent to a running cluster is left to the per-node preflight. Run before a run only."""
    device = OmegaConf.select(cfg, "trainer.device", default="cuda")
    address = OmegaConf.select(cfg, "ray_kwargs.ray_init.address", default=None) or os.environ.get("RAY_ADDRESS")
    if device != "cuda" or address:
        return
    import torch

    if not torch.cuda.is_available():
        raise MachineCheckError(
            f"trainer.device=cuda, but this machine's torch {torch.__version__} ({sys.executable}) sees no CUDA "
            "device and the job starts its own Ray here: run it on a GPU node, send it to a cluster "
            "(ray_kwargs.ray_init.address or RAY_ADDRESS), or run on the CPU (+device=cpu)"
        )


def _check_reuse(cfg: Any) -> None:
    train = OmegaConf.select(cfg, "data.train_batch_size", default=None)
    mini = OmegaConf.select(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size", default=None)
    if not isinstance(train, int) or not isinstance(mini, int) or isinstance(train, bool):
        return
    reuse_of(train, mini)


def _check_kernel_hyperparameters(cfg: Any) -> None:
    for block, cls in CONFIG_BLOCKS.items():
        path = f"{POLICY_LOSS}.{block}"
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
        try:
            cls(**values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None


def _check_routing(cfg: Any) -> None:
    mode = replay_mode(cfg)
    engine = OmegaConf.select(cfg, "model_engine", default=None)
    if mode == "off" or engine == ROUTING_ENGINE:
        return
    raise ValueError(
        f"routing replay needs model_engine={ROUTING_ENGINE}, got model_engine={engine} "
        f"with {REPLAY_KEY}={verl_mode(mode)}"
    )
