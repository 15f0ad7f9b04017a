"""Which checkpoint a run may resume from: run fingerprints, complete and half-written checkpoints.

verl 0.9.1's ``trainer.resume_mode=auto`` resumes from whatever :data:`TRACKER` names, whoever wrote it. Every
checkpoint the respo-verl trainer saves carries :data:`MARKER` (the run's :func:`fingerprint` and the files the save
wrote, :func:`manifest`), written once verl's save has returned and the step's metrics are in the log; before Ray
starts, :func:`plan_resume` decides what the run resumes from
(docs/internals.md, "The respo-verl trainer and its checkpoints"). Imports omegaconf only (it runs in the driver
before anything heavy).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

MARKER = "respo_verl_run.json"
TRACKER = "latest_checkpointed_iteration.txt"
# The integrity check of a file reads this much at its start and as much at its end: headers, and the tail where a
# zip archive (torch.save) keeps its central directory, which a truncated or half-copied file loses first.
CHECK_BYTES = 64 * 1024
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


def hashed_config(cfg: Any, without: Iterable[str], resolve: bool = True) -> dict:
    """The configuration as plain data, less the dotted keys ``without``: what :func:`config_hash` hashes."""
    container = OmegaConf.to_container(cfg, resolve=resolve, throw_on_missing=False)
    for dotted in without:
        *parents, leaf = dotted.split(".")
        node = container
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return container


def config_hash(cfg: Any, without: Iterable[str], resolve: bool = True) -> str:
    """sha256 (hex) of :func:`hashed_config`: the identity of a configuration, for a checkpoint's run
    (:func:`fingerprint`) and for a sweep's runs (the manifest's ``config_hash``)."""
    blob = json.dumps(hashed_config(cfg, without, resolve), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


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
    return config_hash(cfg, PER_ATTEMPT_KEYS)[:16]


def identity(cfg: Any) -> dict:
    """What a checkpoint's :data:`MARKER` says about its run: fingerprint, summary and the hashed configuration."""
    return {"fingerprint": fingerprint(cfg), "summary": summary(cfg), "config": hashed_config(cfg, PER_ATTEMPT_KEYS)}


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


def write_atomic(path: Path, text: str, mode: int = 0o644) -> Path:
    """Write ``text`` to ``path`` through a temporary file beside it (``.<name>.<random>``), renamed over it: a
    reader never sees half of it, a kill leaves no partial file under its name, and a symbolic link planted under
    its name is replaced, not written through."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_marker_info(folder: Path, info: dict) -> Path:
    """Write :data:`MARKER` into a checkpoint folder (:func:`write_atomic`)."""
    return write_atomic(Path(folder) / MARKER, json.dumps(info, indent=1, default=str) + "\n")


def file_check(path: Path) -> str:
    """The cheap integrity check of one file: sha256 (16 hex digits) of its first and last :data:`CHECK_BYTES`
    bytes (the whole file when it is shorter than twice that). Reads at most 128 KiB, whatever the file's size."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        digest.update(fh.read(CHECK_BYTES))
        if size > CHECK_BYTES:
            fh.seek(max(CHECK_BYTES, size - CHECK_BYTES))
            digest.update(fh.read(CHECK_BYTES))
    return digest.hexdigest()[:16]


def manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under ``folder`` but the marker: its path relative to ``folder``, size in bytes and
    :func:`file_check`."""
    folder = Path(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.parent == folder and (path.name == MARKER or path.name.startswith(f".{MARKER}.")):
            continue
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "check": file_check(path)}
    return files


def verify(folder: Path, files: dict[str, dict[str, Any]]) -> str | None:
    """What is wrong with ``folder`` against the file list its marker recorded (:func:`manifest`), in a few words
    naming the file, or None: every file is there, with its size and its check. Files the list does not name are
    not looked at."""
    folder = Path(folder)
    for name, expected in sorted(files.items()):
        path = folder / name
        try:
            size = path.stat().st_size
            if size != expected.get("size"):
                return f"{path} has {size} bytes, the save wrote {expected.get('size')}"
            if expected.get("check") is not None and file_check(path) != expected["check"]:
                return f"{path}: its first and last {CHECK_BYTES // 1024} KiB differ from what the save wrote"
        except FileNotFoundError:
            return f"{path} is missing"
        except OSError as exc:
            return f"{path} cannot be read: {exc.strerror or exc}"
    return None


def marker_problem(folder: Path) -> tuple[str | None, bool]:
    """(what is wrong with the complete checkpoint ``folder`` or None, whether its marker lists its files)."""
    info = json.loads((Path(folder) / MARKER).read_text())
    files = info.get("files")
    if files is None:
        return None, False
    return verify(folder, files), True


def _describe(info: dict) -> str:
    s = info.get("summary", {})
    return (
        f"{s.get('loss')} N={s.get('N')} (train_batch_size {s.get('train_batch_size')}, mini-batch "
        f"{s.get('ppo_mini_batch_size')}), n={s.get('n')}, seed {s.get('seed')}, model {s.get('model')}, "
        f"fingerprint {info.get('fingerprint')}"
    )


@dataclass(frozen=True)
class ResumePlan:
    """What the run will do about its checkpoint folder: resume from ``resume_from`` (None: start from scratch), after
    printing ``warnings`` loudly (half-written checkpoints skipped, checkpoints without a marker)."""

    resume_from: Path | None
    warnings: tuple[str, ...] = ()


def checkpoint_folder(cfg: Any) -> Path:
    """``trainer.default_local_dir`` as verl resolves it (relative to the working directory)."""
    return Path.cwd() / Path(str(OmegaConf.select(cfg, "trainer.default_local_dir"))).expanduser()


def plan_resume(cfg: Any, run: dict | None = None) -> ResumePlan:
    """Decide the resume of a ``trainer.resume_mode=auto`` run from its checkpoint folder, or verify the checkpoint
    ``trainer.resume_mode=resume_path`` names (docs/internals.md, "The respo-verl trainer and its checkpoints").
    ``run``: the run's :func:`identity` when the caller took it earlier (the trainer, before verl adds its own keys
    to the configuration); by default it is taken from ``cfg``.

    Raises:
        CheckpointError: the checkpoint belongs to another configuration or is damaged (one line: what to do).
    """
    folder = checkpoint_folder(cfg)
    mode = str(OmegaConf.select(cfg, "trainer.resume_mode", default="auto"))
    if mode == "resume_path":
        named = OmegaConf.select(cfg, "trainer.resume_from_path")
        path = Path.cwd() / Path(str(named)).expanduser() if named else None  # an absolute path stays
        if path is not None and (path / MARKER).is_file() and (problem := marker_problem(path)[0]):
            raise CheckpointError(
                f"DAMAGED CHECKPOINT {path} (trainer.resume_from_path): {problem}; name another checkpoint"
            )
        return ResumePlan(None)
    if mode != "auto" or not folder.is_dir():
        return ResumePlan(None)
    steps = sorted((int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name)))
    if not steps:
        return ResumePlan(None)
    complete = [(k, p) for k, p in steps if (p / MARKER).is_file()]
    tracker = folder / TRACKER
    tracked = int(tracker.read_text().strip()) if tracker.is_file() else None
    if not complete and tracked is None:
        return ResumePlan(None, (f"{folder}: checkpoint folders but no {TRACKER}: starting from scratch",))
    if not complete:
        unmarked = (
            f"{folder}/global_step_{tracked} has no {MARKER} (saved without the respo-verl trainer): its "
            "configuration cannot be checked; resuming from it as verl would"
        )
        return ResumePlan(folder / f"global_step_{tracked}", (unmarked,))
    warnings = []
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
    problem, listed = marker_problem(path)
    if not listed:
        warnings.append(
            f"{path} was saved before checkpoints listed their files (its {MARKER} has none): its files are not "
            "verified; resuming from it"
        )
    elif problem:
        raise CheckpointError(f"DAMAGED CHECKPOINT {path}: {problem}; {_way_out(complete, step)}")
    return ResumePlan(path, tuple(warnings))


def _way_out(complete: list[tuple[int, Path]], damaged: int) -> str:
    """The override that resumes from the newest complete checkpoint before ``damaged`` whose files verify."""
    for k, p in reversed(complete):
        if k < damaged and marker_problem(p)[0] is None:
            return (
                f"to resume from global_step_{k}, the newest intact checkpoint before it, add "
                f"trainer.resume_mode=resume_path trainer.resume_from_path={p}"
            )
    return "no intact checkpoint before it: set trainer.resume_mode=disable to start over"
