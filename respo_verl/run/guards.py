"""The run guards on every step's metrics: the ``run_guard`` node of the presets (:class:`GuardConfig`) and the
checks that read a step's metrics (:class:`StepGuards`).

A check is a method of :class:`StepGuards` that reads ``(metrics, step)`` and raises a
:class:`respo_verl.run.stops.RunStopped` naming the metric, its value, the bound and the step; :attr:`StepGuards.checks`
lists them in the order they run. The respo-verl trainer (:mod:`respo_verl.run.trainer`) runs them on every step's
metrics, after verl has computed them and before it logs them. Imports neither verl nor Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from respo_verl.run.stops import RunStopped

FAILED_SAMPLES_KEY = "respo_verl/failed_samples"
FAILED_SHARE_KEY = "respo_verl/failed_share"
# verl's count (summed over a step) of prompt groups whose every sample failed (a reward or rollout that raised):
# the replay buffer evicts them and generates new ones, so the step's batch is full and has no padding.
EVICTED_GROUPS_KEY = "training/rollout_failure/evicted_samples"
# 1.0 on the log line of the step a guard stopped the run in (that step's metrics are logged before the stop).
STOPPED_KEY = "respo_verl/stopped"
ENTROPY_KEY = "actor/entropy"
ADVANTAGE_KEYS = ("critic/advantages/max", "critic/advantages/min")
# The kernel losses' share of sequences whose log W sits at the clamp, under actor/<loss>/.
CLAMP_SUFFIX = "/clamp_frac"


@dataclass(frozen=True)
class GuardConfig:
    """The ``run_guard`` node (defaults: configs/respo_verl/run_guard.yaml; validated here).

    Attributes:
        enable: run the guards and the watchdog at all.
        max_failed_share: the largest share of a step's samples whose reward or rollout failed (replaced by
            padding, or evicted and generated again) that the run tolerates; 0 stops at the first failure.
        max_clamp_share: the largest share of sequences with log W at the clamp (±log_w_clip) tolerated in a step.
        min_entropy: entropy below this counts as collapsed ...
        collapse_steps: ... when, in as many consecutive steps, no group carries a signal (all advantages 0).
        max_stall_s: the watchdog: a step in which no sample finished for this long while it waited for its samples
            (counted from the step's start, the last finished sample, or the last update) stops the run.
        max_stall_after_stop_s: the same, once SIGTERM has asked the run to stop: the shorter bound within which a
            stalled step ends the run without saving (a step that makes progress still saves at its end); it bounds
            a stalled phase after SIGTERM too.
        max_phase_s: the watchdog's phase deadline, measured by the driver: a phase of a step (generation, old
            log-probs, the update, the weight sync, the save, ...) in which nothing ends and nothing progresses
            for this long stops the run (:class:`respo_verl.run.watchdog.PhaseDeadline`).
    """

    enable: bool = True
    max_failed_share: float = 0.0
    max_clamp_share: float = 0.1
    min_entropy: float = 1.0e-3
    collapse_steps: int = 3
    max_stall_s: float = 3600.0
    max_stall_after_stop_s: float = 300.0
    max_phase_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("max_failed_share", "max_clamp_share"):
            value = getattr(self, name)
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"run_guard.{name}={value} must be in [0, 1]")
        if float(self.min_entropy) < 0:
            raise ValueError(f"run_guard.min_entropy={self.min_entropy} must be >= 0")
        if int(self.collapse_steps) < 1:
            raise ValueError(f"run_guard.collapse_steps={self.collapse_steps} must be >= 1")
        for name in ("max_stall_s", "max_stall_after_stop_s", "max_phase_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"run_guard.{name}={getattr(self, name)} must be > 0 (seconds)")

    @classmethod
    def from_config(cls, node: Any) -> GuardConfig:
        known = {f.name for f in fields(cls)}
        given = dict(node or {})
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"run_guard has no key(s) {unknown}; known: {sorted(known)}")
        return cls(**given)


class StepGuards:
    """The guards of :class:`GuardConfig` over a run's steps (pure: metrics in, :class:`RunStopped` out).

    :attr:`checks` holds one method per guard, each ``(metrics, step) -> None``, raising :class:`RunStopped`; a
    further guard on a step's metrics is one more method added to that list.
    """

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._quiet_steps = 0
        self.checks: list[Callable[[dict[str, Any], int], None]] = [
            self.check_failed_samples,
            self.check_clamp_share,
            self.check_collapse,
        ]

    def check(self, metrics: dict[str, Any], step: int) -> None:
        if not self.config.enable:
            return
        for check in self.checks:
            check(metrics, step)

    def check_failed_samples(self, metrics: dict[str, Any], step: int) -> None:
        c = self.config
        share = metrics.get(FAILED_SHARE_KEY)
        if share is not None and share > c.max_failed_share:
            evicted = metrics.get(EVICTED_GROUPS_KEY) or 0
            raise RunStopped(
                f"step {step}: {FAILED_SHARE_KEY}={share:.4f} ({metrics.get(FAILED_SAMPLES_KEY)} samples whose "
                f"reward or rollout failed: replaced by padding, or in the {evicted:g} group(s) verl evicted and "
                f"generated again, {EVICTED_GROUPS_KEY}) > run_guard.max_failed_share={c.max_failed_share}"
            )

    def check_clamp_share(self, metrics: dict[str, Any], step: int) -> None:
        c = self.config
        for key, value in sorted(metrics.items()):
            if key.endswith(CLAMP_SUFFIX) and isinstance(value, int | float) and value > c.max_clamp_share:
                raise RunStopped(
                    f"step {step}: {key}={value:.3f} > run_guard.max_clamp_share={c.max_clamp_share}: log W sits at "
                    "its clamp for that share of the sequences (a collapsed or diverged policy)"
                )

    def check_collapse(self, metrics: dict[str, Any], step: int) -> None:
        c = self.config
        entropy = metrics.get(ENTROPY_KEY)
        extremes = [metrics.get(key) for key in ADVANTAGE_KEYS]
        no_signal = all(v is not None and abs(v) < 1e-12 for v in extremes)
        if entropy is not None and entropy < c.min_entropy and no_signal:
            self._quiet_steps += 1
        else:
            self._quiet_steps = 0
        if self._quiet_steps >= c.collapse_steps:
            raise RunStopped(
                f"step {step}: {ENTROPY_KEY}={entropy:.2e} < run_guard.min_entropy={c.min_entropy} and no group with "
                f"a signal ({', '.join(ADVANTAGE_KEYS)} = 0) for {self._quiet_steps} steps in a row "
                f"(run_guard.collapse_steps={c.collapse_steps}): the policy has collapsed"
            )


def failed_sample_metrics(tags: list[dict], expected: int, evicted_groups: float = 0, group_size: int = 1) -> dict:
    """Samples of a step whose reward or rollout failed, as verl reports them, and their share of the samples the
    step generated.

    Two kinds: samples replaced by padding (``expected``, prompts × n, minus the step's real samples: verl pads a
    batch to a multiple of the data-parallel size too, but only a failure leaves fewer than ``expected`` real
    samples), and the samples of the ``evicted_groups`` prompt groups (:data:`EVICTED_GROUPS_KEY`) that failed whole
    and were generated again, ``group_size`` (n) each.
    """
    if evicted_groups < 0 or float(evicted_groups) != int(evicted_groups):
        raise ValueError(f"{EVICTED_GROUPS_KEY}={evicted_groups} is not a count of groups")
    real = sum(not tag.get("is_padding", False) for tag in tags)
    regenerated = int(evicted_groups) * int(group_size)
    failed = max(0, int(expected) - real) + regenerated
    generated = int(expected) + regenerated
    return {FAILED_SAMPLES_KEY: float(failed), FAILED_SHARE_KEY: failed / generated if generated else 0.0}
