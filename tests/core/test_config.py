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
