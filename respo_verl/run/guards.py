"""The run guards on every step's metrics: the ``run_guard`` node of the presets (:class:`GuardConfig`) and the
checks that read a step's metrics (:class:`StepGuards`).

A check is a method of :class:`StepGuards` that reads ``(metrics, step)`` and raises a
:class:`respo_verl.run.stops.RunStopped` naming the metric, its value, the bound and the step; :attr:`StepGuards.checks`
lists them in the order they run. The respo-verl trainer runs them on every step's metrics, after verl has computed
them and before it logs them. Imports neither verl nor Ray. What each guard reads, its bounds, the order (a stop names
the first cause) and the two guards that can warn instead (:data:`GUARD_MODES`, counted under :data:`WARNINGS_KEY`):
docs/cluster.md, "Run guards".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from respo_verl.core.config import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, OneOf, Range, check_settings, setting
from respo_verl.routing.mode import verl_mode
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
SHARE = Range(0.0, high=1.0)  # [0, 1]: a share of samples, sequences or tokens, or a difference of probabilities
# What a guard does when it trips (the sampler-agreement and routing-replay guards; the others always stop).
GUARD_MODES = ("stop", "warn", "off")
# verl's comparison of the sampler's and the trainer's token probabilities (trainer/ppo/metric_utils.py).
PROBS_DIFF_MAX_KEY = "training/rollout_probs_diff_max"
PROBS_DIFF_MEAN_KEY = "training/rollout_probs_diff_mean"
# The route-drift engine's metrics (respo_verl/routing): the update pass, and compute_log_prob (old log-probs).
ROUTING_PREFIX = "actor/routing"
LOG_PROB_PASS = "compute_log_prob"
# Warnings of a guard set to warn, counted from the run's first step: WARNINGS_KEY/<guard> and their sum.
WARNINGS_KEY = "respo_verl/guard_warnings"


@dataclass(frozen=True)
class GuardConfig:
    """The ``run_guard`` node (defaults here, validated here). Each key, its bound and why: the comments of
    configs/respo_verl/run_guard.yaml, docs/cluster.md ("Run guards", "Exit status") and docs/internals.md (the
    watchdog's bounds). ``enable`` turns the guards, the liveness check and the watchdog's bounds off together.
    """

    enable: bool = True
    max_failed_share: float = setting(0.0, SHARE)
    max_clamp_share: float = setting(0.1, SHARE)
    min_entropy: float = setting(1.0e-3, NON_NEGATIVE)
    collapse_steps: int = setting(3, AT_LEAST_ONE)
    max_stall_s: float = setting(3600.0, POSITIVE)
    max_stall_after_stop_s: float = setting(300.0, POSITIVE)
    max_phase_s: float = setting(1800.0, POSITIVE)
    max_setup_s: float = setting(1800.0, POSITIVE)
    sampler_agreement: str = setting("stop", OneOf(GUARD_MODES))
    max_probs_diff_max: float | None = setting(None, SHARE, optional=True)
    max_probs_diff_mean: float | None = setting(0.05, SHARE, optional=True)
    routing_replay: str = setting("stop", OneOf(GUARD_MODES))
    max_route_reject_share: float = setting(0.3, SHARE)

    def __post_init__(self) -> None:
        check_settings(self, "run_guard")
        if self.sampler_agreement != "off" and self.max_probs_diff_max is None and self.max_probs_diff_mean is None:
            raise ValueError(
                f"run_guard.sampler_agreement={self.sampler_agreement} needs a bound: set run_guard.max_probs_diff_max "
                "or run_guard.max_probs_diff_mean (or sampler_agreement=off)"
            )

    @classmethod
    def from_config(cls, node: Any) -> GuardConfig:
        known = {f.name for f in fields(cls)}
        given = dict(node or {})
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"run_guard has no key(s) {unknown}; known: {sorted(known)}")
        return cls(**given)


def check_guards(cfg: Any) -> GuardConfig:
    """The job's ``run_guard`` node, parsed for the job's view (:meth:`respo_verl.run.jobcheck.Job.of`): ValueError
    with one line naming the key, its value and what it accepts."""
    from omegaconf import OmegaConf

    guard = GuardConfig.from_config(cfg.get("run_guard"))
    logged = OmegaConf.select(cfg, "actor_rollout_ref.rollout.calculate_log_probs", default=True)
    if guard.enable and guard.sampler_agreement != "off" and not logged:
        raise ValueError(
            f"run_guard.sampler_agreement={guard.sampler_agreement} compares the sampler's log-probs with the "
            "trainer's, but actor_rollout_ref.rollout.calculate_log_probs=false: set it to true (verl's default) "
            "or run_guard.sampler_agreement=off"
        )
    return guard


class StepGuards:
    """The guards of :class:`GuardConfig` over a run's steps (pure: metrics in, :class:`RunStopped` out; the module
    docstring says how a check is written and added to :attr:`checks`)."""

    def __init__(self, config: GuardConfig, replay: str = "off") -> None:
        """``replay``: the run's routing replay mode (:func:`respo_verl.routing.mode.replay_mode`: off, r2, r3)."""
        self.config = config
        self.replay = replay
        self._quiet_steps = 0
        self.warnings: dict[str, int] = {}
        self.checks: list[Callable[[dict[str, Any], int], None]] = [
            self.check_failed_samples,
            self.check_replayed_routes,
            self.check_sampler_agreement,
            self.check_route_rejects,
            self.check_clamp_share,
            self.check_collapse,
        ]

    def check(self, metrics: dict[str, Any], step: int) -> None:
        """Run every check on ``metrics`` of ``step``; a guard set to warn adds its counts to ``metrics``."""
        if not self.config.enable:
            return
        for check in self.checks:
            check(metrics, step)
        if self.warnings:
            metrics.update({f"{WARNINGS_KEY}/{name}": float(count) for name, count in self.warnings.items()})
            metrics[WARNINGS_KEY] = float(sum(self.warnings.values()))

    def _trip(self, guard: str, message: str) -> None:
        """Stop with ``message``, or (``run_guard.<guard>=warn``) print it as one line and count it."""
        if getattr(self.config, guard) == "stop":
            raise RunStopped(message)
        self.warnings[guard] = self.warnings.get(guard, 0) + 1
        print(f"respo-verl: WARNING: run_guard.{guard}=warn: {message}", flush=True)

    def check_replayed_routes(self, metrics: dict[str, Any], step: int) -> None:
        mode, verl = self.config.routing_replay, verl_mode(self.replay)
        if mode == "off" or self.replay == "off":
            return
        sampled = "the sampler's routes"
        sources = {  # the passes that replay, and the routes each replays
            "r3": {LOG_PROB_PASS: f"{sampled} (rollout.enable_rollout_routing_replay)", "update": sampled},
            "r2": {"update": "the routes recorded at compute_log_prob"},
        }[self.replay]
        # The route-drift engine logs a pass's keys only when it counted a replayed token there: with the engine's
        # keys of another pass in the step, a pass without keys replayed none.
        engine_ran = any(key.startswith(f"{ROUTING_PREFIX}/") for key in metrics)
        for name, source in sources.items():
            key = f"{ROUTING_PREFIX}/{'' if name == 'update' else name + '/'}replayed_tokens"
            value = metrics.get(key)
            if value is None and engine_ran:
                value = 0.0
            if value is None:
                self._trip(
                    "routing_replay",
                    f"step {step}: router_replay.mode={verl} but {key} is missing: the route-drift "
                    f"engine did not run (select it with routing={self.replay}), so replay is "
                    "unchecked",
                )
            elif value <= 0:
                self._trip(
                    "routing_replay",
                    f"step {step}: {key}={value:g} with router_replay.mode={verl}: the {name} pass "
                    f"replayed no route; {source} were missing or all zero (a sampler that returns no routes, e.g. "
                    "a MoE kernel that skips vLLM's capture hook), and the trainer routed on its own",
                )

    def check_sampler_agreement(self, metrics: dict[str, Any], step: int) -> None:
        c = self.config
        if c.sampler_agreement == "off":
            return
        for key, bound, name in (
            (PROBS_DIFF_MAX_KEY, c.max_probs_diff_max, "max_probs_diff_max"),
            (PROBS_DIFF_MEAN_KEY, c.max_probs_diff_mean, "max_probs_diff_mean"),
        ):
            if bound is None:
                continue
            value = metrics.get(key)
            if value is not None and value > bound:
                self._trip(
                    "sampler_agreement",
                    f"step {step}: {key}={value:.3g} > run_guard.{name}={bound:g}: the sampler's token probabilities "
                    "disagree with the trainer's before its first update of the step; usually the weights did not "
                    "all reach the sampler (names its loader skipped, a failed sync), or sampler and trainer compute "
                    "different models (dtype, kernels, routes)",
                )

    def check_route_rejects(self, metrics: dict[str, Any], step: int) -> None:
        mode = self.config.routing_replay
        if mode == "off" or self.replay != "r3":
            return
        prefix = f"{ROUTING_PREFIX}/{LOG_PROB_PASS}/flip_frac/layer_"
        shares = {int(k[len(prefix) :]): v for k, v in metrics.items() if k.startswith(prefix) and v is not None}
        if not shares:
            return  # no replayed token in this step: check_replayed_routes has said so
        layer, share = max(shares.items(), key=lambda item: (item[1], -item[0]))
        bound = self.config.max_route_reject_share
        if share > bound:
            self._trip(
                "routing_replay",
                f"step {step}: layer {layer}: {share:.3f} of the replayed tokens' routes are not the trainer's "
                f"router's top-k at compute_log_prob ({prefix}{layer}) > run_guard.max_route_reject_share={bound:g}: "
                "the sampler's routes belong to other weights or another model",
            )

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
