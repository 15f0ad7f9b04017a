"""The per-run patches of verl 0.9.1's objects that the respo-verl trainer (:mod:`respo_verl.run.respo_trainer`)
applies once verl has built them, and the order it gives a step's samples. Imports no verl: the trainer hands each
patch the objects it changes.
"""

from __future__ import annotations

import dataclasses
import importlib
from contextlib import contextmanager
from typing import Any

from respo_verl.patches import Patch

TIMED_MODULES = ("verl.trainer.ppo.v1.trainer_base", "verl.trainer.ppo.v1.trainer_sync")
TIMERS_PATCH_NAME = "respo-verl trainer's phases from verl's step timers"
HOOKS_PATCH_NAME = "respo-verl trainer's logger and sampler hooks"


def trainer_hooks(logger: Any, after_log: Any, buffer: Any, reorder: Any) -> Patch:
    """The patch of the two verl objects one run's trainer holds (verl 0.9.1's ``Tracking`` and ``ReplayBuffer``):
    ``logger.log`` calls ``after_log(step)`` once a step's line is logged (the checkpoint marker waits for it), and
    ``buffer.sample`` returns its train batches through ``reorder`` (the data loader's order). Public methods of
    verl's objects, replaced on these two instances only."""

    def install(patch: Patch) -> None:
        log, sample = logger.log, buffer.sample

        def log_then_mark(*args, **kwargs):
            log(*args, **kwargs)
            after_log(kwargs.get("step", args[1] if len(args) > 1 else None))

        def sample_in_order(*args, **kwargs):
            batch, metrics = sample(*args, **kwargs)
            return (reorder(batch) if batch.partition_id == "train" else batch), metrics

        patch.replace(logger, "log", log_then_mark, "marks a saved step's checkpoint once the step's line is logged")
        patch.replace(buffer, "sample", sample_in_order, "train batches in the data loader's order")

    return Patch(HOOKS_PATCH_NAME, "verl", "0.9.1", install)


def in_prompt_order(batch, prompt_order: dict[str, int]):
    """``batch`` (a TransferQueue ``KVBatchMeta`` of the train partition) with its samples, and their tags, sorted
    by the data loader's position of their prompt (``prompt_order``: uid -> position), then by session and index."""

    def rank(key: str) -> tuple[int, int, int]:
        parts = key.split("_")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"sample key {key!r} is not verl's {{uid}}_{{session_id}}_{{index}}")
        if parts[0] not in prompt_order:
            raise ValueError(f"sample key {key!r}: its prompt {parts[0]!r} did not come from the train data loader")
        return prompt_order[parts[0]], int(parts[1]), int(parts[2])

    order = sorted(range(len(batch.keys)), key=lambda i: rank(batch.keys[i]))
    return dataclasses.replace(batch, keys=[batch.keys[i] for i in order], tags=[batch.tags[i] for i in order])


def phase_timers(enter_phase: Any) -> Patch:
    """The patch that makes verl 0.9.1's step timers (``marked_timer``, imported by name into its V1 trainer
    modules) also run the phase they time under ``enter_phase(label)`` (a context manager; the labels:
    :data:`respo_verl.run.roles.TIMED_PHASES`)."""

    def install(patch: Patch) -> None:
        for name in TIMED_MODULES:
            module = importlib.import_module(name)
            timer = module.marked_timer

            @contextmanager
            def timed_phase(label, *args, _timer=timer, **kwargs):
                with _timer(label, *args, **kwargs), enter_phase(label):
                    yield

            patch.replace(module, "marked_timer", timed_phase, "each timed phase of a step goes on the phase record")

    return Patch(TIMERS_PATCH_NAME, "verl", "0.9.1", install)
