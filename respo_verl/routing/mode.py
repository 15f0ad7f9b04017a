"""Routing replay's mode, in one vocabulary across the package: ``off``, ``r2``, ``r3``, the names of the
``routing=`` presets (configs/routing/) and of ``respo-verl sweep --routing``.

verl spells them ``disabled``, ``R2``, ``R3`` in ``actor_rollout_ref.actor.megatron.router_replay.mode``; they are
translated here, where a job's configuration is read (:func:`replay_mode`) and where a message names verl's key
(:func:`verl_mode`), and nowhere else. Imports omegaconf only, when a configuration is read.
"""

from __future__ import annotations

from typing import Any

REPLAY_MODES = ("off", "r2", "r3")
# verl's key, read from the actor (the presets set the reference model's to the same value)
REPLAY_KEY = "actor_rollout_ref.actor.megatron.router_replay.mode"
_VERL_SPELLING = {"off": "disabled", "r2": "R2", "r3": "R3"}


def replay_mode(config: Any) -> str:
    """The routing replay mode of a composed job (``DictConfig``): one of :data:`REPLAY_MODES`; ``off`` where the
    job has no :data:`REPLAY_KEY` (an engine without routing replay).

    Raises:
        ValueError: one line naming the key, for a value verl does not take.
    """
    from omegaconf import OmegaConf

    return mode_of(OmegaConf.select(config, REPLAY_KEY, default=None))


def mode_of(value: Any) -> str:
    """verl's ``router_replay.mode`` value (None: not set) in the package's vocabulary (see :func:`replay_mode`)."""
    if value is None:
        return "off"
    for mode, spelling in _VERL_SPELLING.items():
        if value == spelling:
            return mode
    raise ValueError(f"{REPLAY_KEY}={value}: verl takes {', '.join(_VERL_SPELLING.values())}")


def verl_mode(mode: str) -> str:
    """A mode of :data:`REPLAY_MODES` as verl spells it in ``router_replay.mode``."""
    return _VERL_SPELLING[mode]
