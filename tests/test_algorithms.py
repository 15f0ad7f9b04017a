"""One list of algorithms: every name is a shipped preset, the order is the paper's, parsing refuses typos."""

from __future__ import annotations

from importlib import resources

import pytest

from respo_verl import algorithms


def test_every_algorithm_is_a_shipped_preset_and_every_preset_is_listed():
    presets = resources.files("respo_verl.configs") / "algorithm"
    shipped = {p.name.removesuffix(".yaml") for p in presets.iterdir() if p.name.endswith(".yaml")}
    assert set(algorithms.ALGORITHMS) | set(algorithms.ABLATIONS) == shipped
    assert not set(algorithms.ALGORITHMS) & set(algorithms.ABLATIONS)


def test_order_display_and_baseline():
    assert algorithms.ALGORITHMS == ("respo", "vespo", "grpo", "gspo")
    assert [algorithms.display_name(a) for a in algorithms.ALGORITHMS] == ["ReSPO", "VESPO", "GRPO", "GSPO"]
    assert sorted(["gspo", "respo", "grpo", "vespo"], key=algorithms.order) == list(algorithms.ALGORITHMS)
    assert algorithms.BASELINE in algorithms.ALGORITHMS
    assert len({algorithms.get(a).color for a in algorithms.ALGORITHMS}) == 4


@pytest.mark.parametrize(("text", "match"), [("respo,ppo", "unknown algorithm 'ppo'"), ("respo,,vespo", "comma"),
                                             ("", "comma"), ("respo,respo", "repeats")])  # fmt: skip
def test_parse_list_refuses_bad_lists(text, match):
    with pytest.raises(ValueError, match=match):
        algorithms.parse_list(text)
    assert algorithms.parse_list(" respo , vespo ") == ("respo", "vespo")
