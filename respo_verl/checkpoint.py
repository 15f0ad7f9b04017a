"""Which checkpoint a run may resume from: run fingerprints, complete and half-written checkpoints.

verl 0.9.1's ``trainer.resume_mode=auto`` resumes from whatever :data:`TRACKER` names, whoever wrote it. Every
checkpoint the respo-verl trainer saves carries :data:`MARKER` (the run's :func:`fingerprint` and the files the save
wrote, :func:`manifest`), written once verl's save has returned and the step's metrics are in the log; before Ray
starts, :func:`plan_resume` decides what the run resumes from
(docs/internals.md, "The respo-verl trainer and its checkpoints"). The marker also records the parallel layout the
checkpoint was saved on (:func:`checkpoint_layout`); the layout is not part of the fingerprint but compared apart
(:func:`layout_verdict`), so that a run relaunched on another number of nodes resumes where megatron-core can
reshard its checkpoint and is refused, naming the ways out, where it cannot. Imports omegaconf and
:mod:`respo_verl.layout` only (it runs in the driver before anything heavy).
"""

from __future__ import annotations

import copy
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

from respo_verl.layout.parallel import FSDP, MEGATRON, Layout, LayoutError, layout_from_config
from respo_verl.layout.rules import reuse_of

MARKER = "respo_verl_run.json"
TRACKER = "latest_checkpointed_iteration.txt"
# The integrity check of a file reads this much at its start and as much at its end: headers, and the tail where a
# zip archive (torch.save) keeps its central directory, which a truncated or half-copied file loses first.
CHECK_BYTES = 64 * 1024
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
# Keys a resumed run may change without becoming another run: where and how it logs, saves, validates and resumes,
# how long it runs, and the Ray/cluster plumbing (verl's driver switches TransferQueue on by itself). The layout
# (LAYOUT_KEYS) is compared apart. Everything else (model, data, batch sizes, N, seeds, the kernel settings, the
# optimiser's hyper-parameters and offload, routing replay, the rollout's parallel sizes, a critic's layout) is part
# of the fingerprint.
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
# The parallel layout of the actor and the reference (verl's engine keys under <role>.megatron and <role>.fsdp_config),
# the node count and GPUs per node (and the rollout's copies of them, interpolated from trainer.*), and the format of
# the optimizer's checkpoint: they leave the fingerprint, the marker records them (checkpoint_layout), and
# plan_resume compares them apart (layout_verdict). The reference saves no checkpoint; the critic's keys stay in the
# fingerprint (no preset trains one).
_ENGINE_LAYOUT_KEYS = (
    "megatron.tensor_model_parallel_size",
    "megatron.pipeline_model_parallel_size",
    "megatron.virtual_pipeline_model_parallel_size",
    "megatron.context_parallel_size",
    "megatron.expert_model_parallel_size",
    "megatron.expert_tensor_parallel_size",
    "megatron.use_distributed_optimizer",
    "megatron.dist_ckpt_optim_fully_reshardable",
    "megatron.distrib_optim_fully_reshardable_mem_efficient",
    "fsdp_config.fsdp_size",
    "fsdp_config.ulysses_sequence_parallel_size",
    "ulysses_sequence_parallel_size",
)
LAYOUT_KEYS = (
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "actor_rollout_ref.rollout.nnodes",
    "actor_rollout_ref.rollout.n_gpus_per_node",
    *(f"actor_rollout_ref.{role}.{key}" for role in ("actor", "ref") for key in _ENGINE_LAYOUT_KEYS),
)
# The format of a Megatron actor's optimizer checkpoint, as verl 0.9.1 writes it into the checkpoint's metadata
# (MegatronCheckpointManager._build_sharded_state_dict_metadata, megatron-core >= 0.14) and reads it back on load.
DP_RESHARDABLE = "dp_reshardable"  # verl's default (dist_ckpt_optim_fully_reshardable: false)
FULLY_RESHARDABLE = "fully_reshardable"
FSDP_DTENSOR = "fsdp_dtensor"  # Megatron-FSDP (megatron.use_megatron_fsdp)
NOT_DISTRIBUTED = "not distributed"  # megatron.use_distributed_optimizer: false
FULLY_RESHARDABLE_KEY = f"{MEGATRON}.dist_ckpt_optim_fully_reshardable"
# Layout record field (verl's key name under <role>.megatron / fsdp_config) <- Layout attribute.
_MEGATRON_FIELDS = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
}
_FSDP_FIELDS = {"fsdp_size": "fsdp_size", "ulysses_sequence_parallel_size": "ulysses_sp"}
# A run of its own name, hence its own checkpoint folder: what starts afresh from a checkpoint's weights.
RESTART_OVERRIDE = "trainer.experiment_name=<a new name>"
NODES_GPUS = "nodes × GPUs"  # how a change of trainer.nnodes / trainer.n_gpus_per_node is named
# A model-parallel change megatron-core reshards a fully_reshardable optimizer across, and verl 0.9.1 loads: its RNG
# state is a ShardedObject of global shape (PP, TP) (MegatronCheckpointManager.get_rng_state), which megatron-core
# cannot load at another PP or TP ("Invalid access pattern: 1 ShardedObject are missing"), so TP and PP stay. EP
# changes only while it stays above 1 (EXPERT_OPTIMIZER_FROM).
FULLY_RESHARDABLE_CHANGES = frozenset(
    {
        "virtual_pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
    }
)
# megatron-core 0.16.1 marks expert parameters expert-parallel, and gives them a distributed optimizer of their own
# in its ChainedOptimizer, only at expert_model_parallel_size > 1 (tensor_parallel/layers.py, moe/experts.py,
# optimizer/__init__.py); the optimizer checkpoint keeps one state per chained optimizer, and ChainedOptimizer's
# load_state_dict cannot load two into one or one into two (EP 2 -> 1 from fully_reshardable: KeyError 'optimizer' in
# DistributedOptimizer.load_state_dict).
EXPERT_OPTIMIZER_FROM = 2
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
    return _drop(OmegaConf.to_container(cfg, resolve=resolve, throw_on_missing=False), without)


def _drop(container: dict, without: Iterable[str]) -> dict:
    """``container`` (plain data, changed in place) less the dotted keys ``without``."""
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
    return _digest(hashed_config(cfg, without, resolve))


def _digest(container: Any) -> str:
    blob = json.dumps(container, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def summary(cfg: Any) -> dict[str, Any]:
    """The few keys a person reads to tell two runs apart (N among them)."""
    out = {name: OmegaConf.select(cfg, key) for name, key in SUMMARY_KEYS.items()}
    try:
        out["N"] = reuse_of(out["train_batch_size"], out["ppo_mini_batch_size"])
    except (TypeError, ValueError):  # a summary of any configuration: N where it is one
        out["N"] = None
    return out


def fingerprint(cfg: Any) -> str:
    """Hash of the composed configuration without :data:`PER_ATTEMPT_KEYS` and :data:`LAYOUT_KEYS` (16 hex
    digits)."""
    return config_hash(cfg, (*PER_ATTEMPT_KEYS, *LAYOUT_KEYS))[:16]


def identity(cfg: Any) -> dict:
    """What a checkpoint's :data:`MARKER` says about its run: fingerprint, summary, the hashed configuration
    (without :data:`PER_ATTEMPT_KEYS`; the layout keys in it too, to name what differs) and the layout
    (:func:`checkpoint_layout`).

    Raises:
        LayoutError: a layout key whose value verl would not take, or no ``trainer.nnodes`` / ``n_gpus_per_node``.
    """
    return {
        "fingerprint": fingerprint(cfg),
        "summary": summary(cfg),
        "config": hashed_config(cfg, PER_ATTEMPT_KEYS),
        "layout": checkpoint_layout(cfg),
    }


def _unmarked_fingerprint(run: dict) -> str:
    """The fingerprint a marker without a layout holds for the run ``run`` (an :func:`identity`): the hash of its
    configuration with the layout keys in it, as markers were written before they recorded the layout."""
    return _digest(run["config"])[:16]


def _without_layout(config: dict) -> dict:
    """A hashed configuration (plain data) less :data:`LAYOUT_KEYS`."""
    return _drop(copy.deepcopy(config), LAYOUT_KEYS)


def checkpoint_layout(cfg: Any) -> dict[str, Any]:
    """The layout a checkpoint is saved on, as its :data:`MARKER` records it: the actor's parallel sizes (verl's key
    names; ``expert_tensor_parallel_size`` resolved as megatron resolves null), its data-parallel size
    (nodes × GPUs / (TP × PP × CP) on Megatron, / Ulysses on FSDP), ``nnodes`` and ``n_gpus_per_node``, on Megatron
    whether the distributed optimizer is on and the format of its checkpoint (:data:`DP_RESHARDABLE`,
    :data:`FULLY_RESHARDABLE`, :data:`FSDP_DTENSOR`, :data:`NOT_DISTRIBUTED`), the routing replay mode and the model
    path. Read through :func:`respo_verl.layout.parallel.layout_from_config`. The routing mode and the model are
    part of the fingerprint too: they are recorded here to be read, not compared.

    Raises:
        LayoutError: a layout key whose value verl would not take, or no ``trainer.nnodes`` / ``n_gpus_per_node``.
    """
    unset = [key for key in ("trainer.nnodes", "trainer.n_gpus_per_node") if OmegaConf.select(cfg, key) is None]
    if unset:
        raise LayoutError(f"{' and '.join(unset)} unset: a checkpoint records the layout it is saved on")
    lay = layout_from_config(cfg)
    fields = _MEGATRON_FIELDS if lay.backend == "megatron" else _FSDP_FIELDS
    record: dict[str, Any] = {"backend": lay.backend}
    record.update({name: getattr(lay, attr) for name, attr in fields.items()})
    record.update({"data_parallel_size": lay.dp, "nnodes": lay.nnodes, "n_gpus_per_node": lay.gpus_per_node})
    if lay.backend == "megatron":
        record["use_distributed_optimizer"] = lay.distributed_optimizer
        record["optimizer_format"] = optimizer_format(cfg, lay)
    record["routing"] = lay.replay
    record["model"] = OmegaConf.select(cfg, "actor_rollout_ref.model.path")
    return record


def optimizer_format(cfg: Any, lay: Layout) -> str:
    """The format verl 0.9.1 saves a Megatron actor's optimizer in (the metadata it writes beside it)."""
    if OmegaConf.select(cfg, f"{MEGATRON}.use_megatron_fsdp", default=False):
        return FSDP_DTENSOR
    if not lay.distributed_optimizer:
        return NOT_DISTRIBUTED
    return FULLY_RESHARDABLE if OmegaConf.select(cfg, FULLY_RESHARDABLE_KEY, default=False) else DP_RESHARDABLE


@dataclass(frozen=True)
class LayoutVerdict:
    """How the layout of a run differs from its checkpoint's: ``changes`` (``name a -> b``, checkpoint -> this run;
    empty: the same layout), whether verl and megatron-core load the checkpoint on the new layout (``resumes``), and
    why, in a few words (``reason``)."""

    changes: tuple[str, ...]
    resumes: bool
    reason: str


def layout_verdict(saved: dict[str, Any], current: dict[str, Any]) -> LayoutVerdict:
    """Compare the layout a checkpoint was saved on with a run's (both :func:`checkpoint_layout` records).

    What resumes, from the saved format (megatron-core's ``DistributedOptimizer.sharded_state_dict``: ``dp_reshardable``
    reshards in data parallel only, ``fully_reshardable`` in every dimension):

    - Megatron, a change of data parallel only (nodes × GPUs, DP; TP, PP, VPP, CP, EP, ETP as saved): from every
      format but Megatron-FSDP's (not checked here, so refused).
    - Megatron, a change of VPP, CP, EP or ETP: from ``fully_reshardable`` only, and EP only while it stays above 1
      (:data:`EXPERT_OPTIMIZER_FROM`). A change of TP or PP never: verl 0.9.1 keeps the RNG state by (PP, TP)
      (:data:`FULLY_RESHARDABLE_CHANGES`). Turning the distributed optimizer on or off never: its checkpoint has
      another form.
    - FSDP: verl saves one file per rank, named by the world size, in shards of the FSDP mesh, and loads the files
      of its own world size only: nodes × GPUs and ``fsdp_size`` stay. A change of Ulysses only resumes (the mesh,
      hence every shard, is the same; the data-parallel size follows).
    """
    changes = _layout_changes(saved, current)
    if not changes:
        return LayoutVerdict((), True, "the same layout")
    shown = tuple(_show(name, a, b) for name, a, b in changes)
    changed = {name for name, _, _ in changes}
    if saved.get("backend") != "megatron":
        if changed & {NODES_GPUS, "fsdp_size"}:
            return LayoutVerdict(
                shown,
                False,
                "verl's FSDP checkpoint holds one file per rank, named by its world size "
                "(model_world_size_<n>_rank_<r>.pt), in shards of the FSDP mesh, and verl 0.9.1 loads the files of "
                "its own world size only",
            )
        return LayoutVerdict(shown, True, "verl's FSDP shards follow the FSDP mesh, which stays as saved")
    fmt = saved.get("optimizer_format")
    saved_as = "the optimizer was saved " + ("without the distributed optimizer" if fmt == NOT_DISTRIBUTED else fmt)
    model_parallel = changed - {NODES_GPUS, "data_parallel_size"}
    if "use_distributed_optimizer" in changed:
        return LayoutVerdict(
            shown, False, "the optimizer's checkpoint has another form with the distributed optimizer on and off"
        )
    if fmt == FSDP_DTENSOR:
        return LayoutVerdict(shown, False, f"{saved_as} (Megatron-FSDP), whose resharding is not checked here")
    if not model_parallel:
        return LayoutVerdict(shown, True, f"{saved_as}: megatron-core reshards it in data parallel")
    if fmt == NOT_DISTRIBUTED:
        return LayoutVerdict(
            shown, False, f"{saved_as}; only a change of data parallel is checked to resume from it here"
        )
    if fmt != FULLY_RESHARDABLE:
        return LayoutVerdict(
            shown,
            False,
            f"{saved_as}, which megatron-core reshards in data parallel only (TP, PP, VPP, CP, EP and ETP as saved)",
        )
    if model_parallel - FULLY_RESHARDABLE_CHANGES:
        return LayoutVerdict(
            shown,
            False,
            f"{saved_as}, but verl 0.9.1 keeps the RNG state by (PP, TP) and cannot load it at another TP or PP",
        )
    experts_apart = [(lay.get("expert_model_parallel_size") or 1) >= EXPERT_OPTIMIZER_FROM for lay in (saved, current)]
    if experts_apart[0] != experts_apart[1]:
        return LayoutVerdict(
            shown,
            False,
            f"{saved_as}, but megatron-core 0.16.1 gives the experts an optimizer of their own only at EP > 1 and "
            "cannot load the state of two optimizers into one, or of one into two",
        )
    return LayoutVerdict(shown, True, f"{saved_as}: megatron-core reshards it")


def _layout_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(name, saved, current) for every compared field that differs, in the order of a layout record."""
    megatron = saved.get("backend") == "megatron"
    names = [*(_MEGATRON_FIELDS if megatron else _FSDP_FIELDS), "data_parallel_size", NODES_GPUS]
    if megatron:
        names.append("use_distributed_optimizer")
    values = [(name, _compared(saved, name), _compared(current, name)) for name in names]
    return [(name, a, b) for name, a, b in values if a != b]


def _compared(layout: dict[str, Any], name: str) -> Any:
    if name == NODES_GPUS:
        return (layout.get("nnodes"), layout.get("n_gpus_per_node"))
    return layout.get(name)


def _show(name: str, a: Any, b: Any) -> str:
    if name == NODES_GPUS:
        return f"{name} {a[0]}×{a[1]} -> {b[0]}×{b[1]}"
    return f"{name} {a} -> {b}"


def _saved_layout_overrides(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """The overrides that put a run back on the layout its checkpoint was saved on."""
    out = []
    for name, a, _ in _layout_changes(saved, current):
        value = "null" if a is None else str(a).lower() if isinstance(a, bool) else a
        if name == NODES_GPUS:
            out += [f"trainer.nnodes={a[0]}", f"trainer.n_gpus_per_node={a[1]}"]
        elif name == "ulysses_sequence_parallel_size":
            out += [f"actor_rollout_ref.actor.{name}={value}", f"{FSDP}.{name}={value}"]
        elif name == "fsdp_size":
            out.append(f"{FSDP}.{name}={value}")
        elif name in _MEGATRON_FIELDS or name == "use_distributed_optimizer":
            out.append(f"{MEGATRON}.{name}={value}")
    return " ".join(out)


def _weights_way_out(path: Path, backend: str | None) -> str:
    """The second way out of a layout the checkpoint cannot be loaded on, after "or": start from its weights with a
    fresh optimizer and step 0 (docs/cluster.md, "Checkpoints and pre-emption"), its HF copy as the model, in a run
    of its own name (hence its own checkpoint folder, which a relaunch with the same overrides resumes from)."""
    restart = f"with a fresh optimizer and step 0: actor_rollout_ref.model.path={{}} {RESTART_OVERRIDE}"
    if backend == "megatron":
        hf = path / "actor" / "model" / "huggingface"
        if _holds_weights(hf):
            return f"start from its weights {restart.format(hf)}"
        return (
            f"start from HF weights of a checkpoint that holds them: this one does not ({hf}); verl saves them when "
            "actor_rollout_ref.actor.checkpoint.save_contents holds model without megatron.use_dist_checkpointing "
            "(the default), or holds hf_model"
        )
    hf = path / "actor" / "huggingface"
    if _holds_weights(hf):
        return f"start from its weights {restart.format(hf)}"
    merged = "<a folder for its weights>"
    return (
        f"write its weights in HF form (python -m verl.model_merger merge --backend fsdp --local_dir {path / 'actor'} "
        f"--target_dir {merged}) and start from them {restart.format(merged)}"
    )


# HF weight files as transformers and mbridge write them.
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def _holds_weights(folder: Path) -> bool:
    return folder.is_dir() and any(any(folder.glob(pattern)) for pattern in _WEIGHT_PATTERNS)


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
    to the configuration); by default it is taken from ``cfg``. A checkpoint saved on another layout than the run's
    resumes with a warning where verl and megatron-core can load it there (:func:`layout_verdict`).

    Raises:
        CheckpointError: the checkpoint belongs to another configuration, cannot be loaded on the run's layout, or
            is damaged (one line: what to do).
    """
    folder = checkpoint_folder(cfg)
    mode = str(OmegaConf.select(cfg, "trainer.resume_mode", default="auto"))
    if mode == "resume_path":
        named = OmegaConf.select(cfg, "trainer.resume_from_path")
        path = Path.cwd() / Path(str(named)).expanduser() if named else None  # an absolute path stays
        if path is None or not (path / MARKER).is_file():
            return ResumePlan(None)
        if problem := marker_problem(path)[0]:
            raise CheckpointError(
                f"DAMAGED CHECKPOINT {path} (trainer.resume_from_path): {problem}; name another checkpoint"
            )
        info = json.loads((path / MARKER).read_text())
        return ResumePlan(None, _layout_warnings(path, info, run or identity(cfg)))
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
    if "layout" in info:
        same_run = info.get("fingerprint") == ours["fingerprint"]
        theirs, mine = _without_layout(info.get("config", {})), _without_layout(ours["config"])
    else:
        # A marker written before markers recorded the layout: its fingerprint hashed the layout with the rest of
        # the configuration, so a change of layout makes another run of it, as it did when it was written.
        same_run = info.get("fingerprint") == _unmarked_fingerprint(ours)
        theirs, mine = info.get("config", {}), ours["config"]
    if not same_run:
        changed = differing_keys(theirs, mine)
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
    warnings.extend(_layout_warnings(path, info, ours))  # after the files: a damaged one's way out comes first
    return ResumePlan(path, tuple(warnings))


def _layout_warnings(path: Path, info: dict, ours: dict) -> tuple[str, ...]:
    """The line a resume on another layout prints (none on the same layout, or from a marker without a layout).

    Raises:
        CheckpointError: the checkpoint cannot be loaded on this run's layout (one line: the change, why, the ways
            out).
    """
    saved = info.get("layout")
    if saved is None:
        return ()
    verdict = layout_verdict(saved, ours["layout"])
    if not verdict.changes:
        return ()
    change = f"layout changed since {path}: {', '.join(verdict.changes)}"
    if verdict.resumes:
        return (f"{change}; {verdict.reason}",)
    raise CheckpointError(
        f"{change}; {verdict.reason}. Resume on the saved layout ({_saved_layout_overrides(saved, ours['layout'])}), "
        f"or {_weights_way_out(path, saved.get('backend'))}"
    )


def _way_out(complete: list[tuple[int, Path]], damaged: int) -> str:
    """The override that resumes from the newest complete checkpoint before ``damaged`` whose files verify."""
    for k, p in reversed(complete):
        if k < damaged and marker_problem(p)[0] is None:
            return (
                f"to resume from global_step_{k}, the newest intact checkpoint before it, add "
                f"trainer.resume_mode=resume_path trainer.resume_from_path={p}"
            )
    return "no intact checkpoint before it: set trainer.resume_mode=disable to start over"
