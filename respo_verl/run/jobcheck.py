"""A composed job's one typed view (:class:`Job`), which the launcher and the trainer read instead of dotted keys,
and the checks that refuse a job before anything is printed or launched (:func:`check_job`: the entry point, for a
run and ``--cfg job``, the planner and ``respo-verl sweep``), the layout rules (:mod:`respo_verl.layout.rules`)
included, which megatron-core, vLLM and verl would otherwise enforce after Ray has started. Imports neither verl nor
Hydra."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from respo_verl.core.config import CONFIG_BLOCKS
from respo_verl.layout.models import job_model_shape
from respo_verl.layout.parallel import STRATEGY, Layout, layout_from_config
from respo_verl.layout.rules import check_layout, reuse_of
from respo_verl.routing.mode import REPLAY_KEY, mode_of, verl_mode
from respo_verl.run.guards import GuardConfig, check_guards
from respo_verl.run.trainer import TRAINER_MODE

POLICY_LOSS = "actor_rollout_ref.actor.policy_loss"
MODEL_PATH = "actor_rollout_ref.model.path"
# verl's three keys of routing replay: the actor's mode (REPLAY_KEY), the reference model's, and the rollout's flag
# that makes the sampler return its routes (R3's source). The routing presets (configs/routing/) set them together.
REF_REPLAY_KEY = "actor_rollout_ref.ref.megatron.router_replay.mode"
ROLLOUT_REPLAY_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
RESOURCES_KEY = "ray_kwargs.task_runner_resources"


@dataclass(frozen=True)
class Job:
    """The facts of a composed job that more than one part of a run reads."""

    config: DictConfig  # the composed job itself, for the keys only one reader needs
    layout: Layout
    reuse: int  # N, optimizer updates per rollout batch (respo_verl.layout.rules.reuse_of)
    guard: GuardConfig  # the run_guard node, parsed and checked against the rollout's keys
    respo_trainer: bool  # the run trains with the respo-verl trainer (verl's V1 trainer in mode respo_sync)
    trainer_resources: dict[str, float]  # the Ray resources verl's TaskRunner asks for ({}: Ray's choice)

    @property
    def backend(self) -> str:  # megatron or fsdp (respo_verl.layout.parallel.STRATEGY decides)
        return self.layout.backend

    @property
    def replay(self) -> str:  # off, r2 or r3: the three replay keys agree on it, and it needs the Megatron engine
        return self.layout.replay

    @property
    def run_name(self) -> str:  # verl's trainer.experiment_name; the presets derive it by resolvers.run_name
        return str(OmegaConf.select(self.config, "trainer.experiment_name"))

    @classmethod
    def of(cls, config: DictConfig) -> Job:
        """The view of a composed job; ValueError in one line naming the key where a fact is not one: replay keys
        (:func:`check_replay`), N not whole, ``run_guard``, :data:`RESOURCES_KEY`, a layout key of the wrong kind."""
        lay = layout_from_config(config)
        check_replay(config, lay.backend)
        reuse = reuse_of(lay.train_batch_size, lay.ppo_mini_batch_size)
        return cls(config, lay, reuse, check_guards(config), uses_respo_trainer(config), _trainer_resources(config))


def uses_respo_trainer(config: Any) -> bool:  # verl's V1 trainer (verl's default) in the respo-verl trainer's mode
    v1 = OmegaConf.select(config, "trainer.use_v1", default=True)
    return bool(v1) and OmegaConf.select(config, "trainer.v1.trainer_mode") == TRAINER_MODE


def check_replay(config: Any, backend: str) -> None:
    """ValueError in one line where the three routing replay keys disagree (verl would replay on one model only, or
    routes the sampler does not return), or ask for replay off the Megatron engine (the only one verl replays on)."""
    actor, ref, rollout = (OmegaConf.select(config, k) for k in (REPLAY_KEY, REF_REPLAY_KEY, ROLLOUT_REPLAY_KEY))
    mode = mode_of(actor)
    if mode != "off" and backend != "megatron":
        raise ValueError(
            f"routing replay needs model_engine=megatron ({STRATEGY}=megatron), got "
            f"{STRATEGY}={OmegaConf.select(config, STRATEGY)} with {REPLAY_KEY}={actor}"
        )
    if (ref == verl_mode(mode) or (ref is None and mode == "off")) and bool(rollout) == (mode == "r3"):
        return
    raise ValueError(
        f"routing replay: {REPLAY_KEY}={actor}, {REF_REPLAY_KEY}={ref} and {ROLLOUT_REPLAY_KEY}="
        f"{str(rollout).lower()} disagree: R3 sets them R3, R3, true; R2 sets R2, R2, false; no replay disabled, "
        "disabled, false (routing=r3|r2|off sets all three)"
    )


def _trainer_resources(config: Any) -> dict[str, float]:
    """:data:`RESOURCES_KEY`: Ray resources (a custom one that a node was started with keeps the TaskRunner there)."""
    resources = OmegaConf.select(config, RESOURCES_KEY, default=None)
    if resources is not None and not (
        OmegaConf.is_dict(resources)
        and all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in resources.values())
    ):
        raise ValueError(
            f"{RESOURCES_KEY}={resources}: takes a map of Ray resource names to positive amounts, "
            "e.g. {trainer_node: 1}"
        )
    return {str(k): float(v) for k, v in (resources or {}).items()}


class ModelCheckError(ValueError):
    """A model the run cannot load, in one line (:func:`check_model`)."""


def check_job(cfg: Any, layout: bool = True) -> Job:
    """The :class:`Job` of ``cfg`` (as ``--cfg job`` prints it); ValueError in one line naming the key for a job that
    cannot run. The layout rules with ``layout`` (the planner applies them itself), but those on how batches split,
    which verl's ``validate_config`` applies, and those on the model's shape where its ``config.json`` is not here."""
    _check_kernel_hyperparameters(cfg)
    job = Job.of(cfg)
    if layout and (violations := check_layout(job_model_shape(cfg), job.layout, batch=False)):
        raise ValueError(
            f"layout: {len(violations)} rule(s) that megatron-core, vLLM or verl would enforce only after Ray starts: "
            + "; ".join(map(str, violations))
        )
    return job


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
