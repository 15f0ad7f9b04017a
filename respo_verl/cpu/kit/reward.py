"""verl custom reward function of the kit's task.

Selected by the ``+device=cpu`` preset as ``reward.custom_reward_function.path=pkg://respo_verl.cpu.kit.reward`` and
``name=compute_score``; verl calls it once per response with the keywords below.
"""

from __future__ import annotations

from typing import Any

from respo_verl.cpu.kit.task import DATA_SOURCE, score


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None, **kwargs: Any
) -> float:
    """+1.0 for the right ``#### <sum>`` answer, -1.0 otherwise.

    Raises:
        ValueError: a sample from another data source (the kit's reward knows only its own task).
    """
    if data_source != DATA_SOURCE:
        raise ValueError(
            f"respo_verl.cpu.kit.reward scores only {DATA_SOURCE!r} samples, got data_source={data_source!r}"
        )
    return score(solution_str, ground_truth)
