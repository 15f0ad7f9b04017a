"""A run's name (:func:`run_name`, the one scheme), and the OmegaConf resolvers the presets use for a run's identity
and its checkpoint interval.

:func:`register` registers the resolvers (idempotent); the plugin calls it in every verl process and composition
calls it before composing, so that the presets resolve the same wherever a job is composed or resolved. Imports
omegaconf and the package's layout rules and routing modes only.

- ``${respo_verl.run_name:<loss_mode>,<train_batch_size>,<ppo_mini_batch_size>,<seed>,<model path>,<replay>}``:
  :func:`job_run_name`, the default experiment name (and so the default checkpoint folder) of a run;
- ``${respo_verl.save_freq:<updates>,<train_batch_size>,<ppo_mini_batch_size>}``: :func:`save_freq`, so that a
  pre-emption loses the same share of the run at every N.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from respo_verl.layout.rules import reuse_of
from respo_verl.routing.mode import REPLAY_MODES, mode_of

NAMESPACE = "respo_verl"
# verl's loss name -> the algorithm preset that selects it (the name runs carry).
ALGORITHM_OF_LOSS = {"respo": "respo", "vespo": "vespo", "vanilla": "grpo", "gspo": "gspo"}


def run_name(model: str, algorithm: str, reuse: int, seed: int, routing: str | None = None) -> str:
    """A run's name, ``<model>-<algorithm>-n<N>-s<seed>``, then ``-<routing>`` with routing replay on.

    verl's ``trainer.experiment_name``: it names the run's checkpoint folder and its file log, from which the report
    reads the algorithm, N and seed back (respo_verl/tools/report/analysis.py, ``NAME_PATTERN``). The presets
    (:func:`job_run_name`) and the sweep (respo_verl/tools/sweep/grid.py) name their runs with it.

    Args:
        model: a short model tag: the sweep's ``--model``; a preset's, the model folder's name.
        algorithm: the algorithm preset (respo_verl/algorithms.py).
        reuse: N, optimizer updates per rollout batch.
        seed: the run's seed.
        routing: routing replay, one of ``respo_verl.routing.mode.REPLAY_MODES``; None or ``off`` adds nothing.
    """
    if routing is not None and routing not in REPLAY_MODES:
        raise ValueError(f"routing must be one of {', '.join(REPLAY_MODES)}, got {routing!r}")
    name = f"{model}-{algorithm}-n{reuse}-s{seed}"
    return name if routing in (None, "off") else f"{name}-{routing}"


def job_run_name(loss_mode, train_batch_size, mini_batch_size, seed, model_path, replay=None) -> str:
    """:func:`run_name` of a composed job (the presets' ``run_name`` resolver): the model folder's name, the
    algorithm preset that selects ``loss_mode``, N = train_batch_size / mini_batch_size, and verl's
    ``router_replay.mode`` ``replay`` (None or ``disabled``: off)."""
    algorithm = ALGORITHM_OF_LOSS.get(str(loss_mode), str(loss_mode))
    model = PurePosixPath(str(model_path).rstrip("/")).name or "model"
    return run_name(model, algorithm, reuse_of(train_batch_size, mini_batch_size), seed, mode_of(replay))


def save_freq(updates, train_batch_size, mini_batch_size) -> int:
    """Training steps between checkpoints: every ``updates`` optimizer updates, at least every step."""
    return max(1, int(updates) // reuse_of(train_batch_size, mini_batch_size))


def register() -> None:
    """Register the resolvers under ``respo_verl.*`` (idempotent)."""
    from omegaconf import OmegaConf

    for name, function in (("run_name", job_run_name), ("save_freq", save_freq)):
        if not OmegaConf.has_resolver(f"{NAMESPACE}.{name}"):
            OmegaConf.register_new_resolver(f"{NAMESPACE}.{name}", function)
