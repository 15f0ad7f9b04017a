"""Which checkpoint a run may resume from: run fingerprints, complete and half-written checkpoints.

verl 0.9.1 saves ``<trainer.default_local_dir>/global_step_<k>/`` and, once a save is done, writes ``k`` into
``latest_checkpointed_iteration.txt``; ``trainer.resume_mode=auto`` resumes from whatever that file names, whoever
wrote it. Here:

- every checkpoint the respo-verl trainer saves carries :data:`MARKER` with the run's :func:`fingerprint`, written
  after verl's save has returned and the step's metrics are in the log, so it also marks the checkpoint complete
  and its step logged;
- before Ray starts, :func:`plan_resume` looks at the run's folder: a checkpoint of another configuration stops the
  run with one line naming both; a half-written newest checkpoint (a ``global_step_<k>`` folder without the marker)
  is reported loudly and the run resumes from the last complete one.

Imports omegaconf only (it runs in the driver before anything heavy).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

MARKER = "respo_verl_run.json"
TRACKER = "latest_checkpointed_iteration.txt"
STOP_FILE = "STOP"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
# Keys a resumed run may change without becoming another run: where and how it logs, saves, validates and resumes,
# how long it runs, and the Ray/cluster plumbing (verl's driver switches TransferQueue on by itself). Everything else
# (model, data, batch sizes, N, seeds, the kernel settings, the optimiser, the layout) is part of the fingerprint.
PER_ATTEMPT_KEYS = (
    "trainer.total_training_steps",
    "trainer.total_epochs",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.logger",
    "trainer.val_before_train",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep",
    "trainer.default_local_dir",
    "trainer.default_hdfs_dir",
    "trainer.del_local_ckpt_after_load",
    "ray_kwargs",
    "transfer_queue",
    "global_profiler",
    "run_guard",
)
# What the one-line summary of a fingerprint shows, so that a refusal says how two runs differ.
SUMMARY_KEYS = {
    "loss": "actor_rollout_ref.actor.policy_loss.loss_mode",
    "train_batch_size": "data.train_batch_size",
    "ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "n": "actor_rollout_ref.rollout.n",
    "seed": "actor_rollout_ref.rollout.seed",
    "model": "actor_rollout_ref.model.path",
}


class CheckpointError(ValueError):
    """A checkpoint the run must not resume from, in one line."""


def _plain(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    for key in PER_ATTEMPT_KEYS:
        node, *path = key.split(".")
        parent, leaf = container, node
        for part in path:
            parent = parent.get(leaf) if isinstance(parent, dict) else None
            leaf = part
        if isinstance(parent, dict):
            parent.pop(leaf, None)
    return container


def summary(cfg: Any) -> dict[str, Any]:
    """The few keys a person reads to tell two runs apart (N among them)."""
    out = {name: OmegaConf.select(cfg, key) for name, key in SUMMARY_KEYS.items()}
    try:
        out["N"] = int(out["train_batch_size"]) // int(out["ppo_mini_batch_size"])
    except (TypeError, ValueError, ZeroDivisionError):
        out["N"] = None
    return out


def fingerprint(cfg: Any) -> str:
    """Hash of the composed configuration without :data:`PER_ATTEMPT_KEYS` (16 hex digits)."""
    blob = json.dumps(_plain(cfg), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def identity(cfg: Any) -> dict:
    """What a checkpoint's :data:`MARKER` says about its run: fingerprint, summary and the hashed configuration."""
    return {"fingerprint": fingerprint(cfg), "summary": summary(cfg), "config": _plain(cfg)}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def differing_keys(a: dict, b: dict, limit: int = 6) -> list[str]:
    """Up to ``limit`` dotted keys whose values differ between two hashed configurations, as ``key: a -> b``."""
    fa, fb = _flatten(a), _flatten(b)
    keys = sorted(k for k in set(fa) | set(fb) if fa.get(k, "<absent>") != fb.get(k, "<absent>"))
    shown = [f"{k}: {fa.get(k, '<absent>')!r} -> {fb.get(k, '<absent>')!r}" for k in keys[:limit]]
    if len(keys) > limit:
        shown.append(f"... {len(keys) - limit} more")
    return shown


def write_marker_info(folder: Path, info: dict) -> Path:
    """Write :data:`MARKER` into a checkpoint folder (through a temporary file: a kill leaves no partial marker)."""
    path = Path(folder) / MARKER
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(info, indent=1, default=str) + "\n")
    partial.replace(path)
    return path


def stop_request(cfg: Any, cwd: Path | None = None) -> Path:
    """The file whose existence asks the run to save and stop at the end of its step (the entry point writes it on
    SIGTERM): ``STOP`` in the run's checkpoint folder."""
    return checkpoint_folder(cfg, cwd) / STOP_FILE


def _describe(info: dict) -> str:
    s = info.get("summary", {})
    return (
        f"{s.get('loss')} N={s.get('N')} (train_batch_size {s.get('train_batch_size')}, mini-batch "
        f"{s.get('ppo_mini_batch_size')}), n={s.get('n')}, seed {s.get('seed')}, model {s.get('model')}, "
        f"fingerprint {info.get('fingerprint')}"
    )


@dataclass(frozen=True)
class ResumePlan:
    """What the run will do about its checkpoint folder.

    Attributes:
        folder: the run's checkpoint folder (absolute).
        resume_from: the complete checkpoint to resume from, or None to start from scratch.
        warnings: lines to print loudly (half-written checkpoints skipped, checkpoints without a marker).
    """

    folder: Path
    resume_from: Path | None
    warnings: tuple[str, ...] = ()


def checkpoint_folder(cfg: Any, cwd: Path | None = None) -> Path:
    """``trainer.default_local_dir`` as verl resolves it (relative to the working directory)."""
    folder = Path(str(OmegaConf.select(cfg, "trainer.default_local_dir"))).expanduser()
    return folder if folder.is_absolute() else (cwd or Path.cwd()) / folder


def plan_resume(cfg: Any, cwd: Path | None = None, run: dict | None = None) -> ResumePlan:
    """Decide the resume of a ``trainer.resume_mode=auto`` run (see the module docstring).

    ``run`` is the run's :func:`identity` when the caller took it earlier (the trainer takes it before verl adds its
    own keys to the configuration); by default it is taken from ``cfg``.

    Raises:
        CheckpointError: the newest complete checkpoint belongs to another configuration.
    """
    folder = checkpoint_folder(cfg, cwd)
    mode = str(OmegaConf.select(cfg, "trainer.resume_mode", default="auto"))
    if mode != "auto" or not folder.is_dir():
        return ResumePlan(folder, None)
    steps = sorted((int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name)))
    if not steps:
        return ResumePlan(folder, None)
    warnings = []
    complete = [(k, p) for k, p in steps if (p / MARKER).is_file()]
    tracker = folder / TRACKER
    tracked = int(tracker.read_text().strip()) if tracker.is_file() else None
    if not complete:
        if tracked is None:
            return ResumePlan(folder, None, (f"{folder}: checkpoint folders but no {TRACKER}: starting from scratch",))
        warnings.append(
            f"{folder}/global_step_{tracked} has no {MARKER} (saved without the respo-verl trainer): its "
            "configuration cannot be checked; resuming from it as verl would"
        )
        return ResumePlan(folder, folder / f"global_step_{tracked}", tuple(warnings))
    step, path = complete[-1]
    for k, p in steps:
        if k > step:
            warnings.append(
                f"HALF-WRITTEN CHECKPOINT {p} (no {MARKER}: its save or its step's log line did not finish): "
                f"ignored; resuming from global_step_{step}"
            )
    info = json.loads((path / MARKER).read_text())
    ours = run or identity(cfg)
    if info.get("fingerprint") != ours["fingerprint"]:
        changed = differing_keys(info.get("config", {}), ours["config"])
        raise CheckpointError(
            f"{path} belongs to another run ({_describe(info)}); this run is {_describe(ours)}; differing keys "
            f"(checkpoint -> this run): {'; '.join(changed) or 'none recorded'}. Give this run its own "
            "trainer.experiment_name or trainer.default_local_dir, or set trainer.resume_mode=disable to start over"
        )
    return ResumePlan(folder, path, tuple(warnings))
