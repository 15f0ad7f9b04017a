"""Hyperparameters of the sequence-level kernels, each with its single home here.

The YAML presets shipped in ``configs/algorithm`` repeat these defaults so that they show up under
``--cfg job``; a test keeps the two in step. Validation happens at construction, so a bad value fails when the
config is built (in verl: in the driver's ``validate_config`` and again in every worker), naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

# Both papers clamp the sequence log-weight to ±20 so that exp() stays finite in fp32 (e^20 ≈ 4.9e8).
DEFAULT_LOG_W_CLIP = 20.0

ROLLOUT_IS_LEVELS = ("token", "sequence")


def _check_number(owner: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{owner}.{key} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{owner}.{key} must be finite, got {value}")
    return value


def _check_rollout_is_level(owner: str, value: object) -> str:
    # verl broadcasts a sequence-level rollout IS weight to every token; summing its log over tokens would count it
    # |o| times, so the loss has to know which kind it receives.
    if value is None:
        return "token"
    if value not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"{owner}.rollout_is_level must be one of {ROLLOUT_IS_LEVELS} (or null), got {value!r}")
    return str(value)


@dataclass(frozen=True)
class Range:
    """The values a kernel hyperparameter may take: ``low`` (included unless ``low_open``) up to ``high`` (included)."""

    low: float
    low_open: bool = False
    high: float | None = None

    def check(self, owner: str, key: str, value: float) -> None:
        below = value <= self.low if self.low_open else value < self.low
        if below or (self.high is not None and value > self.high):
            raise ValueError(f"{owner}.{key} must be {self}, got {value}")

    def __str__(self) -> str:
        if self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        return f"{'>' if self.low_open else '>='} {self.low:g}"


AT_LEAST_ONE = Range(1.0)
NON_NEGATIVE = Range(0.0)
POSITIVE = Range(0.0, low_open=True)
UNIT_INTERVAL = Range(0.0, low_open=True, high=1.0)  # (0, 1]


@dataclass(frozen=True)
class OneOf:
    """The words a setting may take."""

    words: tuple[str, ...]

    def check(self, owner: str, key: str, value: object) -> None:
        if value not in self.words:
            raise ValueError(f"{owner}.{key} must be one of {', '.join(self.words)}, got {value!r}")


def setting(default: Any, allowed: Range | OneOf, optional: bool = False) -> Any:
    """A config dataclass field with what it allows (and None too where ``optional``), for :func:`check_settings`:
    the one way a config block of the package states and checks its values."""
    return field(default=default, metadata={"allowed": allowed, "optional": optional})


def check_settings(config: Any, owner: str) -> None:
    """Check every field of the dataclass ``config`` made with :func:`setting`, raising with ``<owner>.<key>``: a
    :class:`Range` field must be a finite number in range (an integer where its default is one) and is stored as
    a float (int), a :class:`OneOf` field one of its words. Call it from ``__post_init__``."""
    for f in fields(config):
        allowed, value = f.metadata.get("allowed"), getattr(config, f.name)
        if allowed is None or (value is None and f.metadata["optional"]):
            continue
        if isinstance(allowed, Range):
            number = _check_number(owner, f.name, value)
            allowed.check(owner, f.name, number)
            if isinstance(f.default, int) and not isinstance(f.default, bool):
                if not number.is_integer():
                    raise ValueError(f"{owner}.{f.name} must be an integer, got {value!r}")
                number = int(number)
            object.__setattr__(config, f.name, number)
        else:
            allowed.check(owner, f.name, value)


@dataclass(frozen=True)
class KernelBranch:
    """One branch φ(W; α, β, λ) of the ReSPO kernel family (arXiv 2609.35433; docs/method.md, "Family")."""

    alpha: float
    beta: float
    lam: float


@dataclass
class _KernelConfig:
    """What every kernel config does at construction: :func:`check_settings`, and ``rollout_is_level`` against
    :data:`ROLLOUT_IS_LEVELS` (null: token), naming the key that is wrong."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        object.__setattr__(self, "rollout_is_level", _check_rollout_is_level(owner, self.rollout_is_level))
        check_settings(self, owner)


@dataclass
class ReSPOConfig(_KernelConfig):
    """ReSPO kernel hyperparameters (arXiv 2609.35433, published defaults).

    The positive branch (A ≥ 0) defaults to α=2, β=0.5, λ=2, i.e. φ+(W) = ((1+W)/2)·exp(1−W); the negative branch
    (A < 0) to α=1, β=0.5, λ=2, i.e. φ−(W) = √W·exp(2(1−√W)).

    Attributes:
        alpha_pos, beta_pos, lambda_pos: positive-branch α ≥ 1, β ∈ (0, 1], λ ≥ 0.
        alpha_neg, beta_neg, lambda_neg: negative-branch α ≥ 1, β ∈ (0, 1], λ ≥ 0.
        log_w_clip: C > 0; the sequence log-weight is clamped to [−C, C].
        rollout_is_level: how to fold verl's ``rollout_is_weights`` into log W: ``token`` (per-token weights, their
            logs are summed) or ``sequence`` (one weight broadcast over the tokens, taken once). null means token.
    """

    alpha_pos: float = setting(2.0, AT_LEAST_ONE)
    beta_pos: float = setting(0.5, UNIT_INTERVAL)
    lambda_pos: float = setting(2.0, NON_NEGATIVE)
    alpha_neg: float = setting(1.0, AT_LEAST_ONE)
    beta_neg: float = setting(0.5, UNIT_INTERVAL)
    lambda_neg: float = setting(2.0, NON_NEGATIVE)
    log_w_clip: float = setting(DEFAULT_LOG_W_CLIP, POSITIVE)
    rollout_is_level: str | None = "token"

    @property
    def positive(self) -> KernelBranch:
        return KernelBranch(self.alpha_pos, self.beta_pos, self.lambda_pos)

    @property
    def negative(self) -> KernelBranch:
        return KernelBranch(self.alpha_neg, self.beta_neg, self.lambda_neg)


@dataclass
class VESPOConfig(_KernelConfig):
    """VESPO kernel hyperparameters (arXiv 2602.10693): φ(W) = W^k · exp(λ(1 − W)) per branch.

    Attributes:
        k_pos, lambda_pos: positive-branch (A ≥ 0) exponent k ≥ 0 and tilt λ ≥ 0.
        k_neg, lambda_neg: negative-branch exponent and tilt.
        log_w_clip: C > 0; each token log-ratio and then the sequence sum are clamped to [−C, C], as VESPO does.
        rollout_is_level: as in :class:`ReSPOConfig`.
    """

    k_pos: float = setting(2.0, NON_NEGATIVE)
    lambda_pos: float = setting(3.0, NON_NEGATIVE)
    k_neg: float = setting(3.0, NON_NEGATIVE)
    lambda_neg: float = setting(2.0, NON_NEGATIVE)
    log_w_clip: float = setting(DEFAULT_LOG_W_CLIP, POSITIVE)
    rollout_is_level: str | None = "token"


# The kernel hyperparameter blocks, by their key under ``actor_rollout_ref.actor.policy_loss.<key>``: the one list
# that the verl config class, the job checks and the losses (respo_verl.core.losses.KERNELS, ``blocks``) read.
CONFIG_BLOCKS: dict[str, type[_KernelConfig]] = {"respo": ReSPOConfig, "vespo": VESPOConfig}
