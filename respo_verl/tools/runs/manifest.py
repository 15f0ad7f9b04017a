"""The run manifest: one JSON object per line describing a run of a sweep (or of the miniature).

The report groups runs by (algorithm, N, model, routing replay mode) and refuses to average runs whose
``config_hash`` differ within a group: the hash covers the composed configuration *minus* the swept keys (seed, run
name, logging paths), so two seeds of one setting share it and a changed learning rate does not. A record has no model
field: the report reads the model from the run name (``<model>-<algorithm>-n<N>-s<seed>[-<routing>]``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from respo_verl import algorithms
from respo_verl.checkpoint import write_atomic
from respo_verl.routing.mode import REPLAY_MODES
from respo_verl.tools.runs.logs import LOG_STEPS

MANIFEST_NAME = "manifest.jsonl"

# A run or model name becomes a file name (logs, outputs) and a folder name (checkpoints): one plain name.
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_name(name: str, what: str) -> str:
    """``name`` when it is a plain file name (letters, digits, ``.``, ``_``, ``-``; not starting with ``.``), else
    ValueError naming ``what`` (``..`` or a separator would put its files outside the sweep's folder)."""
    if not isinstance(name, str) or not name or name.startswith(".") or not set(name) <= _NAME_CHARS:
        raise ValueError(
            f"{what} {name!r} is not a plain name (letters, digits, '.', '_' and '-', not starting with '.'): it "
            "names files and folders of the sweep"
        )
    return name


@dataclass
class RunRecord:
    """One run of a comparison.

    Attributes:
        name: run name, also the log file stem (``<name>.jsonl``).
        algorithm: one of :data:`respo_verl.algorithms.NAMES` (the default algorithms and the ablation presets).
        reuse: N, optimizer updates per rollout batch (``train_batch_size / ppo_mini_batch_size``).
        seed: the run's seed.
        log: path of the run's verl file-logger log, relative to the manifest's directory or absolute.
        optimizer_steps: planned optimizer updates (the paper: 1024); a log reaching it is complete.
        config_hash: hash of the configuration without the swept keys (see module docstring).
        command: the command line that runs it.
        env: environment variables the command needs.
        preset, routing: cluster preset and routing replay mode (one of ``off``, ``r2``, ``r3``), when set.
        versions: package versions at sweep time.
        source: ``verl`` (a trainer run) or ``mini`` (the CPU experiment).
        log_step: what the ``step`` of a log line counts: ``training`` (verl: one line per rollout batch, N
            optimizer updates) or ``optimizer`` (the miniature: one line per update).
    """

    name: str
    algorithm: str
    reuse: int
    seed: int
    log: str
    optimizer_steps: int
    config_hash: str
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    preset: str | None = None
    routing: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    source: str = "verl"
    log_step: str = "training"

    def __post_init__(self) -> None:
        check_name(self.name, "run name")
        if self.algorithm not in algorithms.NAMES:
            raise ValueError(
                f"run {self.name}: algorithm must be one of {', '.join(algorithms.NAMES)}, got {self.algorithm!r}"
            )
        for key in ("reuse", "seed", "optimizer_steps"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"run {self.name}: {key} must be an integer, got {value!r}")
        if self.routing is not None and self.routing not in REPLAY_MODES:
            raise ValueError(
                f"run {self.name}: routing must be one of {', '.join(REPLAY_MODES)} (or absent), got {self.routing!r}"
            )
        if self.log_step not in LOG_STEPS:
            raise ValueError(f"run {self.name}: log_step must be one of {LOG_STEPS}, got {self.log_step!r}")
        if self.reuse < 1 or self.optimizer_steps % self.reuse:
            raise ValueError(f"run {self.name}: N = {self.reuse} must divide optimizer_steps = {self.optimizer_steps}")

    @property
    def training_steps(self) -> int:
        return self.optimizer_steps // self.reuse

    @property
    def last_log_step(self) -> int:
        """The ``step`` of the last line of a complete log."""
        return self.optimizer_steps if self.log_step == "optimizer" else self.training_steps


def write_manifest(records: list[RunRecord], directory: Path) -> Path:
    """Write ``records`` to ``directory/manifest.jsonl`` (replacing it) and return the path.

    Written through :func:`respo_verl.checkpoint.write_atomic`: a reader never sees half of it, and a symbolic link
    planted under its name is replaced, not written through.
    """
    directory.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(asdict(r), sort_keys=True) + "\n" for r in records)
    return write_atomic(directory / MANIFEST_NAME, text)


def read_manifest(path: Path) -> list[RunRecord]:
    """Read a manifest; raise ValueError naming the file (missing, unreadable) or the line (malformed record)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such manifest file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the manifest ({exc})") from None
    records = []
    known = set(RunRecord.__dataclass_fields__)
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{path}:{lineno}: not a run record (expected a JSON object)")
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}:{lineno}: unknown manifest fields {sorted(unknown)}")
        try:
            records.append(RunRecord(**raw))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from exc
    return records
