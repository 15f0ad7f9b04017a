"""What a preset's checkpoints cost: how often they are saved, how large each is, how many are kept.

A checkpoint holds what ``actor_rollout_ref.actor.checkpoint.save_contents`` names (verl's default: model, optimizer
and extra, the last a few MB of data-loader and RNG state). Per parameter of the whole model:

- Megatron: the bf16 weights (2 bytes) and the DistributedOptimizer's fp32 main parameters and Adam moments
  (4 + 8 bytes), as dist-checkpointing writes them; 14 bytes in all.
- FSDP: the parameters in ``fsdp_config.model_dtype`` (fp32 by default) and AdamW's two moments in the same dtype;
  12 bytes in all at fp32.
- ``hf_model`` in ``save_contents`` adds a bf16 copy (2 bytes).

The figures are the tensors' bytes; the file system's overhead (metadata, alignment) is not counted.

Host memory of a save in megatron-core's ``fully_reshardable`` format (``+respo_verl=fully_reshardable``;
megatron-core 0.16.1 ``DistributedOptimizer.get_parameter_state_dp_zero`` and
``sharded_param_state_fully_reshardable``), per save process, for the most loaded pipeline stage
(:func:`reshardable_save`). The first rank of each data-parallel group gathers, on the host, the fp32 main
parameter, ``exp_avg`` and ``exp_avg_sq`` of every parameter of its model-parallel shard (P: the non-expert
parameters of its layers / TP plus the embedding or output layer, and its experts / (EP·ETP), as the memory model
counts them) and holds them until the save has written them:

    state = 12 B × P

While it gathers one grad buffer of B parameters (verl's Megatron engine builds one bucket per buffer: a dense and an
expert buffer per model chunk), it also holds its own piece of the three states, copied out (12 B × B / DP of that
buffer: data parallel for dense parameters, expert data parallel for experts), and, per state, the pieces received
and their concatenation, next to the previous state's concatenation (at most 12 B × B):

    peak = state + max over the buffers of 12 B × B × (1 + 1 / DP)

With ``distrib_optim_fully_reshardable_mem_efficient`` (the switch's setting) only the first rank of each
data-parallel group holds this; without it every rank does. A ``dp_reshardable`` save writes each rank's own shards
as they are and gathers nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from respo_verl.checkpoint import DP_RESHARDABLE, FULLY_RESHARDABLE, optimizer_format
from respo_verl.layout.models import ModelShape
from respo_verl.layout.parallel import Layout
from respo_verl.layout.rules import reuse_of
from respo_verl.tools.plan.memory import (
    BF16_BYTES,
    FSDP_DTYPE_BYTES,
    FSDP_PARAM_BYTES,
    MEGATRON_OPTIMIZER_BYTES,
    megatron_rank_figures,
)

GB = 1e9
MODEL_PATH = "actor_rollout_ref.model.path"
# What the checkpoint folder shows in place of a model the user did not give.
MISSING_MODEL_PLACEHOLDER = "MODEL-PATH-MISSING"
# The override that saves the optimizer fully_reshardable (configs/respo_verl/fully_reshardable.yaml).
FULLY_RESHARDABLE_SWITCH = "+respo_verl=fully_reshardable"


def verl_default_model_path() -> str:
    """verl's default ``actor_rollout_ref.model.path`` (its ``model/hf_model.yaml``), read without importing verl."""
    from respo_verl.run.compose import VERL_CONFIG_PACKAGE, package_dir

    return str(OmegaConf.load(package_dir(VERL_CONFIG_PACKAGE) / "model" / "hf_model.yaml").path)


@dataclass(frozen=True)
class ReshardableSave:
    """Host bytes one save process holds while it saves the optimizer ``fully_reshardable`` (module docstring).

    Attributes:
        params: P, the parameters of its model-parallel shard.
        state_bytes: the gathered fp32 state, 12 B × P, held until the save has written it.
        peak_bytes: with the gather's copies of its largest buffer.
    """

    params: int
    state_bytes: float
    peak_bytes: float


def reshardable_save(model: ModelShape, lay: Layout) -> ReshardableSave:
    """The ``fully_reshardable`` save's host memory per save process of a Megatron layout: the pipeline stage with
    the highest peak (module docstring)."""
    worst = None
    for stage in range(lay.pp):
        ranks = megatron_rank_figures(model, lay, stage)
        params = ranks.dense + ranks.expert
        state = MEGATRON_OPTIMIZER_BYTES * params
        buffers = [(c.dense, lay.dp) for c in ranks.chunks] + [(c.expert, lay.expert_dp) for c in ranks.chunks]
        gather = max(MEGATRON_OPTIMIZER_BYTES * size * (1 + 1 / max(dp, 1)) for size, dp in buffers)
        save = ReshardableSave(params=params, state_bytes=float(state), peak_bytes=float(state + gather))
        if worst is None or save.peak_bytes > worst.peak_bytes:
            worst = save
    return worst


@dataclass(frozen=True)
class CheckpointPlan:
    """A preset's checkpoints.

    Attributes:
        every_steps: ``trainer.save_freq`` (training steps; < 1: no checkpoints).
        every_updates: optimizer updates between two checkpoints (every_steps × N).
        keep: ``trainer.max_actor_ckpt_to_keep`` (None: all are kept).
        bytes_each: bytes of one checkpoint.
        folder: ``trainer.default_local_dir``.
        model_missing: ``actor_rollout_ref.model.path`` was not given (it is verl's default model); the folder
            holds :data:`MISSING_MODEL_PLACEHOLDER` where the model's name would be.
        optimizer_format: the format of a Megatron checkpoint's distributed optimizer (``dp_reshardable`` or
            ``fully_reshardable``); None where the checkpoint holds no such optimizer.
        reshardable: what a ``fully_reshardable`` save costs in host memory (the preset's, or what the switch would
            cost), with :attr:`optimizer_format`.
    """

    every_steps: int
    every_updates: int
    keep: int | None
    bytes_each: float
    folder: str
    model_missing: bool = False
    optimizer_format: str | None = None
    reshardable: ReshardableSave | None = None

    @property
    def enabled(self) -> bool:
        return self.every_steps >= 1

    def summary(self) -> str:
        missing = (
            f"; {MODEL_PATH} is missing (set it: the folder name holds {MISSING_MODEL_PLACEHOLDER} in its place)"
            if self.model_missing
            else ""
        )
        if not self.enabled:
            return (
                f"checkpoints: OFF (trainer.save_freq={self.every_steps}): a pre-emption loses the whole run{missing}"
            )
        kept = "all kept" if self.keep is None else f"{self.keep} kept: {self.keep * self.bytes_each / GB:,.0f} GB"
        return (
            f"checkpoints: every {self.every_steps} training steps ({self.every_updates} optimizer updates) and at the "
            f"last; {self.bytes_each / GB:,.0f} GB each, {kept} in {self.folder}{self._optimizer()}{missing}"
        )

    def _optimizer(self) -> str:
        """The optimizer's format, the layout changes a relaunch may make from it, and the host memory per save
        process of a fully_reshardable save."""
        if self.reshardable is None:
            return ""
        cost = (
            f"up to {self.reshardable.peak_bytes / GB:,.0f} GB of host RAM per save process "
            f"({self.reshardable.state_bytes / GB:,.0f} GB of gathered fp32 state: 12 B × "
            f"{self.reshardable.params / 1e9:,.2f} B parameters of its shard)"
        )
        if self.optimizer_format == FULLY_RESHARDABLE:
            return f"; optimizer saved {FULLY_RESHARDABLE} (a relaunch may change DP, VPP, CP, ETP, EP above 1): {cost}"
        return (
            f"; optimizer saved {DP_RESHARDABLE} (a relaunch may change DP only; {FULLY_RESHARDABLE_SWITCH} also "
            f"VPP, CP, ETP and EP above 1, for {cost})"
        )


def checkpoint_bytes(model: ModelShape, lay: Layout, save_contents: list[str], fsdp_dtype: str = "fp32") -> float:
    """Bytes of one checkpoint of ``model`` (see the module docstring)."""
    contents = set(save_contents)
    if lay.backend == "megatron":
        per_param = BF16_BYTES if "model" in contents else 0
        per_param += MEGATRON_OPTIMIZER_BYTES if "optimizer" in contents else 0
    else:
        dtype = FSDP_DTYPE_BYTES.get(str(fsdp_dtype), FSDP_PARAM_BYTES)
        per_param = (dtype if "model" in contents else 0) + (2 * dtype if "optimizer" in contents else 0)
    per_param += BF16_BYTES if "hf_model" in contents else 0
    return float(per_param * model.total_params)


def checkpoint_plan(model: ModelShape, lay: Layout, cfg: DictConfig) -> CheckpointPlan:
    """The checkpoints of the composed job ``cfg``."""
    actor = cfg.actor_rollout_ref.actor
    every = int(cfg.trainer.save_freq)
    reuse = reuse_of(cfg.data.train_batch_size, actor.ppo_mini_batch_size)
    keep = cfg.trainer.get("max_actor_ckpt_to_keep")
    contents = list(OmegaConf.select(actor, "checkpoint.save_contents", default=["model", "optimizer", "extra"]))
    dtype = OmegaConf.select(actor, "fsdp_config.model_dtype", default="fp32") or "fp32"
    # A preset without a model inherits verl's default model, whose name would end up in the folder.
    missing = OmegaConf.select(cfg, MODEL_PATH, default=None) in (None, verl_default_model_path())
    if missing:
        cfg = copy.deepcopy(cfg)
        OmegaConf.update(cfg, MODEL_PATH, MISSING_MODEL_PLACEHOLDER)
    fmt = optimizer_format(cfg, lay) if lay.backend == "megatron" and "optimizer" in contents else None
    reshardable = fmt in (DP_RESHARDABLE, FULLY_RESHARDABLE)
    return CheckpointPlan(
        every_steps=every,
        every_updates=every * reuse,
        keep=None if keep is None else int(keep),
        bytes_each=checkpoint_bytes(model, lay, contents, dtype),
        folder=str(cfg.trainer.default_local_dir),
        model_missing=missing,
        optimizer_format=fmt if reshardable else None,
        reshardable=reshardable_save(model, lay) if reshardable else None,
    )
