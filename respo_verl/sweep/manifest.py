"""The run manifest: one JSON object per line describing a run of a sweep (or of ``respo-verl mini``).

The report groups runs by (algorithm, N) and refuses to average runs whose ``config_hash`` differ within a group:
the hash covers the composed configuration *minus* the swept keys (seed, run name, logging paths), so two seeds of
one setting share it and a changed learning rate does not.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_NAME = "manifest.jsonl"
LOG_STEPS = ("training", "optimizer")


@dataclass
class RunRecord:
    """One run of a comparison.

    Attributes:
        name: run name, also the log file stem (``<name>.jsonl``).
        algorithm: ``respo``, ``vespo``, ``grpo`` or ``gspo``.
        reuse: N, optimizer updates per rollout batch (``train_batch_size / ppo_mini_batch_size``).
        seed: the run's seed.
        log: path of the run's verl file-logger log, relative to the manifest's directory or absolute.
        optimizer_steps: planned optimizer updates (the paper: 1024); a log reaching it is complete.
        config_hash: hash of the configuration without the swept keys (see module docstring).
        command: the command line that runs it.
        env: environment variables the command needs.
        preset, routing: cluster preset and routing mode, when set.
        versions: package versions at sweep time.
        source: ``verl`` (a trainer run) or ``mini`` (the CPU experiment).
        log_step: what the ``step`` of a log line counts: ``training`` (verl: one line per rollout batch, N
            optimizer updates) or ``optimizer`` (``respo-verl mini``: one line per update).
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
    """Write ``records`` to ``directory/manifest.jsonl`` (replacing it) and return the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / MANIFEST_NAME
    path.write_text("".join(json.dumps(asdict(r), sort_keys=True) + "\n" for r in records))
    return path


def read_manifest(path: Path) -> list[RunRecord]:
    """Read a manifest; raise ValueError naming the line for a malformed record."""
    records = []
    known = set(RunRecord.__dataclass_fields__)
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}:{lineno}: unknown manifest fields {sorted(unknown)}")
        try:
            records.append(RunRecord(**raw))
        except TypeError as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from exc
    return records
