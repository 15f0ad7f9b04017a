"""Routing replay's mode in one vocabulary: ``off``, ``r2``, ``r3``, the ``routing=`` presets' names (configs/routing/).

verl spells them ``disabled``, ``R2``, ``R3`` in its ``router_replay.mode``: they are translated here, where a job's
configuration is read (:func:`replay_mode`) and where a message names verl's key (:func:`verl_mode`), and nowhere else.
"""

from __future__ import annotations

from typing import Any

REPLAY_MODES = ("off", "r2", "r3")
REPLAY_KEY = "actor_rollout_ref.actor.megatron.router_replay.mode"  # the actor's (the presets set the ref's alike)
_VERL_SPELLING = {"off": "disabled", "r2": "R2", "r3": "R3"}


def replay_mode(config: Any) -> str:
    """The routing replay mode of a composed job (``DictConfig``), one of :data:`REPLAY_MODES`: ``off`` without
    :data:`REPLAY_KEY` (an engine without routing replay). ValueError in one line for a value verl does not take."""
    from omegaconf import OmegaConf

    return mode_of(OmegaConf.select(config, REPLAY_KEY, default=None))


def mode_of(value: Any) -> str:
    """verl's ``router_replay.mode`` value (None: unset) in the package's vocabulary."""
    for mode, spelling in _VERL_SPELLING.items():
        if value == spelling or (value is None and mode == "off"):
            return mode
    raise ValueError(f"{REPLAY_KEY}={value}: verl takes {', '.join(_VERL_SPELLING.values())}")


def verl_mode(mode: str) -> str:
    """A mode of :data:`REPLAY_MODES` as verl spells it."""
    return _VERL_SPELLING[mode]
