"""Hyperparameter validation at construction, naming the key."""

from __future__ import annotations

import pytest

from respo_verl.core.config import ReSPOConfig, VESPOConfig


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("alpha_pos", 0.99, "alpha_pos must be >= 1"),
        ("alpha_neg", 0.0, "alpha_neg must be >= 1"),
        ("beta_pos", 0.0, r"beta_pos must be in \(0, 1\]"),
        ("beta_neg", 1.01, r"beta_neg must be in \(0, 1\]"),
        ("lambda_pos", -0.1, "lambda_pos must be >= 0"),
        ("lambda_neg", -1.0, "lambda_neg must be >= 0"),
        ("log_w_clip", 0.0, "log_w_clip must be > 0"),
        ("log_w_clip", -5.0, "log_w_clip must be > 0"),
        ("alpha_pos", float("nan"), "alpha_pos must be finite"),
        ("beta_pos", float("inf"), "beta_pos must be finite"),
        ("rollout_is_level", "tok", "rollout_is_level must be one of"),
    ],
)
def test_respo_config_rejects_invalid_values(key, value, match):
    with pytest.raises(ValueError, match=f"ReSPOConfig.{match}"):
        ReSPOConfig(**{key: value})


@pytest.mark.parametrize("value", ["2", None, True])
def test_respo_config_rejects_non_numbers(value):
    with pytest.raises(TypeError, match=r"ReSPOConfig\.alpha_pos must be a number"):
        ReSPOConfig(alpha_pos=value)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("k_pos", -1.0, "k_pos must be >= 0"),
        ("lambda_neg", -0.5, "lambda_neg must be >= 0"),
        ("log_w_clip", 0.0, "log_w_clip must be > 0"),
    ],
)
def test_vespo_config_rejects_invalid_values(key, value, match):
    with pytest.raises(ValueError, match=f"VESPOConfig.{match}"):
        VESPOConfig(**{key: value})


def test_boundary_values_are_accepted_and_ints_become_floats():
    cfg = ReSPOConfig(alpha_pos=1, beta_pos=1, lambda_pos=0, rollout_is_level=None)
    assert cfg.positive.alpha == 1.0 and isinstance(cfg.alpha_pos, float)
    assert cfg.rollout_is_level == "token"
    assert ReSPOConfig(rollout_is_level="sequence").rollout_is_level == "sequence"


def test_check_settings_states_ranges_words_integers_and_null_in_one_line_each():
    from dataclasses import dataclass

    from respo_verl.core.config import UNIT_INTERVAL, OneOf, Range, check_settings, setting

    @dataclass
    class Block:
        share: float = setting(0.5, UNIT_INTERVAL)
        steps: int = setting(3, Range(1.0))
        mode: str = setting("stop", OneOf(("stop", "warn", "off")))
        bound: float | None = setting(None, UNIT_INTERVAL, optional=True)

        def __post_init__(self) -> None:
            check_settings(self, "block")

    assert Block(share=1, steps=2.0) == Block(share=1.0, steps=2)  # numbers stored as floats, integers as int
    assert isinstance(Block(steps=2.0).steps, int)
    for kwargs, message in [
        ({"share": 0.0}, "block.share must be in (0, 1], got 0.0"),
        ({"steps": 2.5}, "block.steps must be an integer, got 2.5"),
        ({"steps": 0}, "block.steps must be >= 1, got 0.0"),
        ({"mode": 1e-12}, "block.mode must be one of stop, warn, off, got 1e-12"),
        ({"bound": 2}, "block.bound must be in (0, 1], got 2.0"),
        ({"share": "a"}, "block.share must be a number, got 'a' (str)"),
    ]:
        with pytest.raises((ValueError, TypeError)) as info:
            Block(**kwargs)
        assert str(info.value) == message
