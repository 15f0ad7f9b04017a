"""OmegaConf resolvers the presets use for a run's identity and its checkpoint interval.

:func:`register` registers them (idempotent); the plugin calls it in every verl process and composition calls it
before composing, so that the presets resolve the same wherever a job is composed or resolved. Imports omegaconf
and the package's layout rules only.

- ``${respo_verl.run_name:<loss_mode>,<train_batch_size>,<ppo_mini_batch_size>,<seed>,<model path>,<replay>}``:
  :func:`run_name`, the default experiment name (and so the default checkpoint folder) of a run;
- ``${respo_verl.save_freq:<updates>,<train_batch_size>,<ppo_mini_batch_size>}``: :func:`save_freq`, so that a
  pre-emption loses the same share of the run at every N.
"""

from __future__ import annotations

from pathlib import PurePosixPath

NAMESPACE = "respo_verl"
# verl's loss name -> the algorithm preset that selects it (the name runs carry).
ALGORITHM_OF_LOSS = {"respo": "respo", "vespo": "vespo", "vanilla": "grpo", "gspo": "gspo"}


def _reuse(train_batch_size, mini_batch_size) -> int:
    from respo_verl.layout.rules import reuse_violation

    train, mini = int(train_batch_size), int(mini_batch_size)
    if violation := reuse_violation(train, mini):
        raise ValueError(violation.message)
    return train // mini


def run_name(loss_mode, train_batch_size, mini_batch_size, seed, model_path, replay=None) -> str:
    """``<algorithm>_n<N>_seed<seed>_<model folder name>[_<routing>]``, N = train_batch_size / mini_batch_size;
    ``replay`` is verl's ``router_replay.mode`` (None or ``disabled``: no suffix)."""
    from respo_verl.routing.mode import mode_of

    algorithm = ALGORITHM_OF_LOSS.get(str(loss_mode), str(loss_mode))
    model = PurePosixPath(str(model_path).rstrip("/")).name or "model"
    name = f"{algorithm}_n{_reuse(train_batch_size, mini_batch_size)}_seed{seed}_{model}"
    mode = mode_of(replay)
    return name if mode == "off" else f"{name}_{mode}"


def save_freq(updates, train_batch_size, mini_batch_size) -> int:
    """Training steps between checkpoints: every ``updates`` optimizer updates, at least every step."""
    return max(1, int(updates) // _reuse(train_batch_size, mini_batch_size))


def register() -> None:
    """Register the resolvers under ``respo_verl.*`` (idempotent)."""
    from omegaconf import OmegaConf

    for name, function in (("run_name", run_name), ("save_freq", save_freq)):
        if not OmegaConf.has_resolver(f"{NAMESPACE}.{name}"):
            OmegaConf.register_new_resolver(f"{NAMESPACE}.{name}", function)
