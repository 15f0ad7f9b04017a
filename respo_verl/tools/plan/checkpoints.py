"""What a preset's checkpoints cost: how often they are saved, how large each is, how many are kept.

A checkpoint holds what ``actor_rollout_ref.actor.checkpoint.save_contents`` names (verl's default: model, optimizer
and extra, the last a few MB of data-loader and RNG state). Per parameter of the whole model:

- Megatron: the bf16 weights (2 bytes) and the DistributedOptimizer's fp32 main parameters and Adam moments
  (4 + 8 bytes), as dist-checkpointing writes them; 14 bytes in all.
- FSDP: the parameters in ``fsdp_config.model_dtype`` (fp32 by default) and AdamW's two moments in the same dtype;
  12 bytes in all at fp32.
- ``hf_model`` in ``save_contents`` adds a bf16 copy (2 bytes).

The figures are the tensors' bytes; the file system's overhead (metadata, alignment) is not counted.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from respo_verl.layout.models import ModelShape
from respo_verl.layout.parallel import Layout
from respo_verl.tools.plan.memory import (
    BF16_BYTES,
    FSDP_DTYPE_BYTES,
    FSDP_PARAM_BYTES,
    MEGATRON_OPTIMIZER_BYTES,
)

GB = 1e9
MODEL_PATH = "actor_rollout_ref.model.path"
# What the checkpoint folder shows in place of a model the user did not give.
MISSING_MODEL_PLACEHOLDER = "MODEL-PATH-MISSING"


def verl_default_model_path() -> str:
    """verl's default ``actor_rollout_ref.model.path`` (its ``model/hf_model.yaml``), read without importing verl."""
    from respo_verl.run.compose import VERL_CONFIG_PACKAGE, package_dir

    return str(OmegaConf.load(package_dir(VERL_CONFIG_PACKAGE) / "model" / "hf_model.yaml").path)


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
    """

    every_steps: int
    every_updates: int
    keep: int | None
    bytes_each: float
    folder: str
    model_missing: bool = False

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
            f"last; {self.bytes_each / GB:,.0f} GB each, {kept} in {self.folder}{missing}"
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
    reuse = int(cfg.data.train_batch_size) // int(actor.ppo_mini_batch_size)
    keep = cfg.trainer.get("max_actor_ckpt_to_keep")
    contents = list(OmegaConf.select(actor, "checkpoint.save_contents", default=["model", "optimizer", "extra"]))
    dtype = OmegaConf.select(actor, "fsdp_config.model_dtype", default="fp32") or "fp32"
    # A preset without a model inherits verl's default model, whose name would end up in the folder.
    missing = OmegaConf.select(cfg, MODEL_PATH, default=None) in (None, verl_default_model_path())
    if missing:
        cfg = copy.deepcopy(cfg)
        OmegaConf.update(cfg, MODEL_PATH, MISSING_MODEL_PLACEHOLDER)
    return CheckpointPlan(
        every_steps=every,
        every_updates=every * reuse,
        keep=None if keep is None else int(keep),
        bytes_each=checkpoint_bytes(model, lay, contents, dtype),
        folder=str(cfg.trainer.default_local_dir),
        model_missing=missing,
    )
