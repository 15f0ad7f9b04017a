"""verl custom reward function of the kit's tasks (addition and the chain).

Selected by the ``+device=cpu`` preset as ``reward.custom_reward_function.path=pkg://respo_verl.cpu.kit.reward`` and
``name=compute_score``; verl calls it once per response with the keywords below.
"""

from __future__ import annotations

from typing import Any

from respo_verl.cpu.kit import chain, task

SCORERS = {task.DATA_SOURCE: task.score, chain.DATA_SOURCE: chain.score}


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None, **kwargs: Any
) -> float:
    """+1.0 for the right answer of the sample's task (``#### <sum>``, or the complete chain), -1.0 otherwise.

    Raises:
        ValueError: a sample from another data source (the kit's reward knows only its own tasks).
    """
    if data_source not in SCORERS:
        raise ValueError(
            f"respo_verl.cpu.kit.reward scores only {sorted(SCORERS)} samples, got data_source={data_source!r}"
        )
    return SCORERS[data_source](solution_str, ground_truth)
