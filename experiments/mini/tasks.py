"""The miniature's tasks, by name: ``chain`` (``task.py``, the default) and ``fork`` (``fork.py``).

A task is a module (for the fork task, a ``fork.Fork``) with one interface: the special tokens (``PAD``, ``BOS``,
``EOS``), ``VOCAB_SIZE``, ``PROMPT_LEN``, ``MAX_RESPONSE_LEN``, ``sample_prompts``, ``breaks_grammar``,
``response_lengths``, ``steps_written``, ``Ending``. What differs between the two is adapted here, in :class:`Task`,
and nowhere else: whether the verifier and the endings read the prompt (the fork task's right length depends on it),
how the warm start's answers are made, what of the task enters the base model's recipe key, which endings the run
logs, and whether the regime checks include the high tail (``regime.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tasks import torch; the CLI checks a task's name before it needs torch
    import torch

    from experiments.mini.task import Prompts

DEFAULT = "chain"
NAMES = ("chain", "fork")


@dataclass(frozen=True)
class Task:
    """One task of the miniature.

    Attributes:
        name: its registry name (``--task``); the chain task's runs keep their names, the others' start with it.
        module: the module with the grammar, the verifier and the constants (the interface above).
        ending_metrics: ``mini/<name>_frac`` → the ``module.Ending`` value it counts.
        high_tail: the regime checks include the high tail of the negatives (``regime.HIGH_TAIL_KEYS``).
        warm_start_answers: the warm start's answers to a batch of prompts (token lists), or None for the chain
            task, whose data ``model.py`` makes from the knobs of ``model.WarmStart``.
        recipe: what of the task enters the base model's recipe key, or None for the chain task (its key is the
            one its shipped base models carry).
        warm_start_steps: the warm start's steps when no ``--warm-start-steps`` is given (None: ``model.WarmStart``'s
            default, the chain task's 3000).
    """

    name: str
    module: ModuleType
    ending_metrics: dict[str, int]
    high_tail: bool
    warm_start_answers: Callable[[Prompts, torch.Generator], list[list[int]]] | None
    recipe: dict | None
    warm_start_steps: int | None
    _verify: Callable[[torch.Tensor, Prompts], torch.Tensor]
    _ending: Callable[[torch.Tensor, Prompts], torch.Tensor]

    def verify(self, response: torch.Tensor, prompts: Prompts) -> torch.Tensor:
        """(B,) rewards ±1 of the B responses to these prompts (one prompt row per response)."""
        return self._verify(response, prompts)

    def ending(self, response: torch.Tensor, prompts: Prompts) -> torch.Tensor:
        """(B,) how each response ended, a ``module.Ending`` value per row."""
        return self._ending(response, prompts)

    def run_name(self, name: str) -> str:
        """A run's name under this task: the chain task's unchanged, another's prefixed with the task's name."""
        return name if self.name == DEFAULT else f"{self.name}_{name}"


def _chain() -> Task:
    from experiments.mini import task

    return Task(
        name="chain",
        module=task,
        ending_metrics={"gave_up": task.Ending.GAVE_UP, "slipped": task.Ending.SLIPPED},
        high_tail=False,
        warm_start_answers=None,
        recipe=None,
        warm_start_steps=None,
        _verify=lambda response, _prompts: task.verify(response),
        _ending=lambda response, _prompts: task.ending(response),
    )


def _fork() -> Task:
    from experiments.mini import fork

    grammar = fork.FORK
    return Task(
        name=grammar.name,
        module=grammar,
        ending_metrics=dict(fork.ENDING_METRICS),
        high_tail=True,
        warm_start_answers=grammar.warm_start_answers,
        recipe=grammar.recipe(),
        warm_start_steps=fork.WARM_START_STEPS,
        _verify=grammar.verify,
        _ending=grammar.ending,
    )


_BUILDERS = {"chain": _chain, "fork": _fork}


@functools.cache
def get(name: str) -> Task:
    """The task called ``name`` (one of :data:`NAMES`); a :class:`ValueError` naming the tasks otherwise."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown task {name!r}; the tasks are {', '.join(NAMES)}")
    return _BUILDERS[name]()
