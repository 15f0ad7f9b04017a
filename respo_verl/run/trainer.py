"""The respo-verl trainer: verl 0.9.1's synchronous PPO trainer with the guards a days-long run needs.

Registered through verl's public trainer registry as ``respo_sync`` (:data:`REGISTRATION`, applied by the plugin,
which waits until verl imports its V1 trainers) and selected by the algorithm presets with verl's own
``trainer.v1.trainer_mode``. It adds, to verl's ``PPOTrainerSync`` and nothing else:

- **checkpoints that know their run.** After verl has saved a checkpoint and logged its step's metrics,
  :mod:`respo_verl.run.checkpoint`'s marker (the run's fingerprint) is written into it; before verl resumes, the
  folder is checked: a checkpoint of another configuration stops the run, one without the marker (half-written, or
  its step's line never logged) is skipped loudly (:func:`respo_verl.run.checkpoint.plan_resume`).
- **a log that keeps every step.** verl's file logger opens its file with ``"wb"``; the trainer applies
  :data:`respo_verl.patches.verl_0_9_1.FILE_LOGGER_APPEND`, under which a resumed run appends to its log after a
  line that marks the resume (:data:`respo_verl.patches.verl_0_9_1.RESUME_EVENT`).
- **a stop on request.** When :func:`respo_verl.run.checkpoint.stop_request` exists (the entry point writes it on
  SIGTERM), the trainer saves a checkpoint at the end of the current step and ends the run.
- **samples in the order of the data loader.** verl's replay buffer hands a step its samples in the order the
  rollouts finished; the trainer puts them in the data loader's order of their prompts, then by sample
  (:func:`in_prompt_order`), so that a step's batch, and every sum over it, does not depend on the rollouts' timing.
  Two runs with verl's ``rollout.full_determinism`` (and a resumed run and an uninterrupted one) then agree to the
  last bit in every metric, not only in the weights.
- **guards** on every step's metrics (:class:`GuardConfig`, the ``run_guard`` node of the presets): samples whose
  reward or rollout failed, replaced by padding or evicted by verl and generated again
  (``respo_verl/failed_samples``, ``.../failed_share``, :func:`failed_sample_metrics`) above a share, and
  a collapsed policy (the clamp share of log W above a bound, or entropy near 0 with no group that carries a signal
  for K steps in a row) stop the run with the metric and the step named. A guard on a step's metrics first logs
  that step, to every logger verl was given, with ``respo_verl/stopped`` = 1 (:data:`STOPPED_KEY`), then stops the
  run; non-finite rewards (the advantage computation) and log-probs (the loss) stop it naming the step.
- **a watch over the waits verl would never end.** While verl's replay buffer waits for a step's samples (it polls
  with no timeout), the actors the step waits on are checked for life (:func:`watched_actors`: agent-loop and
  reward-loop workers, rollout servers and their load balancer), and a step in which no sample finishes for
  ``run_guard.max_stall_s`` (``max_stall_after_stop_s`` once SIGTERM has asked for a stop) is stopped
  (:class:`SampleWaitWatch`); a dead actor that a ``ray.get`` of the step meets is named with its step too
  (:func:`stop_for_error`).

Every stop is a :class:`respo_verl.run.stops.RunStopped`, whose class gives the entry point its one line and exit
status (:mod:`respo_verl.run.stops`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from respo_verl.patches import Patch
from respo_verl.run.stops import (
    ActorDied,
    NonFinite,
    RunStopped,
    StalledAfterStop,
    StepStalled,
    actor_died_cause,
)

logger = logging.getLogger(__name__)

TRAINER_MODE = "respo_sync"
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_sync"
FAILED_SAMPLES_KEY = "respo_verl/failed_samples"
FAILED_SHARE_KEY = "respo_verl/failed_share"
# verl's count (summed over a step) of prompt groups whose every sample failed (a reward or rollout that raised):
# the replay buffer evicts them and generates new ones, so the step's batch is full and has no padding.
EVICTED_GROUPS_KEY = "training/rollout_failure/evicted_samples"
# 1.0 on the log line of the step a guard stopped the run in (that step's metrics are logged before the stop).
STOPPED_KEY = "respo_verl/stopped"
# Popped by verl's loop before it logs a step: a table for its own logger, not a metric.
DAPO_COUNTS_KEY = "_dapo_filtered_reward_counts"
ENTROPY_KEY = "actor/entropy"
ADVANTAGE_KEYS = ("critic/advantages/max", "critic/advantages/min")
# The kernel losses' share of sequences whose log W sits at the clamp, under actor/<loss>/.
CLAMP_SUFFIX = "/clamp_frac"
# While a step waits for its samples, how often the actors it waits on are checked for life (one Ray call each, all
# at once); a failed sample (verl then generates its group again) checks them at once.
WORKER_CHECK_INTERVAL_S = 10.0
# A live actor answers its readiness call at once unless its event loop is blocked; longer counts as alive.
WORKER_READY_TIMEOUT_S = 5.0

__all__ = ["ActorDied", "GuardConfig", "NonFinite", "RunStopped", "StalledAfterStop", "StepGuards", "StepStalled"]


@dataclass(frozen=True)
class GuardConfig:
    """The ``run_guard`` node (defaults: configs/respo_verl/run_guard.yaml; validated here).

    Attributes:
        enable: run the guards at all.
        max_failed_share: the largest share of a step's samples whose reward or rollout failed (replaced by
            padding, or evicted and generated again) that the run tolerates; 0 stops at the first failure.
        max_clamp_share: the largest share of sequences with log W at the clamp (±log_w_clip) tolerated in a step.
        min_entropy: entropy below this counts as collapsed ...
        collapse_steps: ... when, in as many consecutive steps, no group carries a signal (all advantages 0).
        max_stall_s: the watchdog: a step in which no sample finished for this long while it waited for its samples
            (counted from the step's start, the last finished sample, or the last update) stops the run.
        max_stall_after_stop_s: the same, once SIGTERM has asked the run to stop: the shorter bound within which a
            stalled step ends the run without saving (a step that makes progress still saves at its end).
    """

    enable: bool = True
    max_failed_share: float = 0.0
    max_clamp_share: float = 0.1
    min_entropy: float = 1.0e-3
    collapse_steps: int = 3
    max_stall_s: float = 3600.0
    max_stall_after_stop_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("max_failed_share", "max_clamp_share"):
            value = getattr(self, name)
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"run_guard.{name}={value} must be in [0, 1]")
        if float(self.min_entropy) < 0:
            raise ValueError(f"run_guard.min_entropy={self.min_entropy} must be >= 0")
        if int(self.collapse_steps) < 1:
            raise ValueError(f"run_guard.collapse_steps={self.collapse_steps} must be >= 1")
        for name in ("max_stall_s", "max_stall_after_stop_s"):
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
    """The guards of :class:`GuardConfig` over a run's steps (pure: metrics in, :class:`RunStopped` out)."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._quiet_steps = 0

    def check(self, metrics: dict[str, Any], step: int) -> None:
        c = self.config
        if not c.enable:
            return
        share = metrics.get(FAILED_SHARE_KEY)
        if share is not None and share > c.max_failed_share:
            evicted = metrics.get(EVICTED_GROUPS_KEY) or 0
            raise RunStopped(
                f"step {step}: {FAILED_SHARE_KEY}={share:.4f} ({metrics.get(FAILED_SAMPLES_KEY)} samples whose "
                f"reward or rollout failed: replaced by padding, or in the {evicted:g} group(s) verl evicted and "
                f"generated again, {EVICTED_GROUPS_KEY}) > run_guard.max_failed_share={c.max_failed_share}"
            )
        for key, value in sorted(metrics.items()):
            if key.endswith(CLAMP_SUFFIX) and isinstance(value, int | float) and value > c.max_clamp_share:
                raise RunStopped(
                    f"step {step}: {key}={value:.3f} > run_guard.max_clamp_share={c.max_clamp_share}: log W sits at "
                    "its clamp for that share of the sequences (a collapsed or diverged policy)"
                )
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


def watched_actors(trainer: Any) -> list[tuple[str, list]]:
    """The Ray actors a step of verl 0.9.1's V1 trainer waits on while it waits for its samples, by kind: the
    agent-loop workers (they run the rollouts), the reward-loop workers (the agent loop asks them for every
    sample's reward), the rollout servers and their load balancer (the agent loop asks them for every token). A
    kind the run does not have is left out. The worker groups (actor, reference, critic) and TransferQueue are not
    here: the step calls them with ``ray.get``, which raises Ray's ``ActorDiedError`` for a dead one
    (:func:`stop_for_error`)."""
    agent_loop = getattr(trainer, "agent_loop_manager", None)
    reward_loop = getattr(trainer, "reward_loop_manager", None)
    servers = getattr(trainer, "llm_server_manager", None)
    balancer = getattr(servers, "global_load_balancer", None)
    kinds = [
        ("agent-loop worker", getattr(agent_loop, "agent_loop_workers", None)),
        ("reward-loop worker", getattr(reward_loop, "reward_loop_workers", None)),
        ("rollout server", getattr(servers, "server_handles", None)),
        ("rollout load balancer", [balancer] if balancer is not None else None),
    ]
    return [(kind, list(handles)) for kind, handles in kinds if handles]


def check_actors_alive(actors: list[tuple[str, list]], step: int, waiting_for: str) -> None:
    """Raise :class:`ActorDied` when one of ``actors`` (:func:`watched_actors`) has died: Ray's ``ActorDiedError``
    for its readiness call. All are asked at once; one busy past :data:`WORKER_READY_TIMEOUT_S`, or unreachable for
    a moment (``ActorUnavailableError``, which Ray raises for a network blip too), counts as alive: the next check
    asks again."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    calls = [
        (kind, index, len(handles), h.__ray_ready__.remote())
        for kind, handles in actors
        for index, h in enumerate(handles)
    ]
    if not calls:
        return
    ready, _ = ray.wait([ref for *_, ref in calls], num_returns=len(calls), timeout=WORKER_READY_TIMEOUT_S)
    answered = set(ready)
    for kind, index, count, ref in calls:
        if ref not in answered:
            continue
        try:
            ray.get(ref)
        except ActorUnavailableError:
            continue
        except ActorDiedError as exc:
            who, reason = actor_died_cause(exc)
            raise ActorDied(
                f"step {step}: {kind} {index} of {count} ({who}) has died while the step waited for {waiting_for}: "
                f"{reason}"
            ) from None


def stop_for_error(exc: BaseException, step: int) -> RunStopped | None:
    """The stop for an error that ended a step where no watch was waiting (a ``ray.get`` of the step): a dead Ray
    actor (:class:`ActorDied`, its class, pid and Ray's cause), or non-finite values refused by the loss
    (``FloatingPointError``, :class:`NonFinite`); None for any other error."""
    from respo_verl.run.stops import causes

    chain = causes(exc)
    for inner in reversed(chain):
        if any(cls.__name__ == "ActorDiedError" for cls in type(inner).__mro__):
            who, reason = actor_died_cause(inner)
            return ActorDied(f"step {step}: {who} has died while the step waited for it: {reason}")
    for inner in reversed(chain):
        if isinstance(inner, FloatingPointError):
            first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
            return NonFinite(f"step {step}: FloatingPointError: {first}")
    return None


class SampleWaitWatch:
    """What the respo-verl trainer checks while verl's replay buffer waits for a step's samples (verl 0.9.1 polls
    with no timeout): the actors the step waits on are alive (:func:`check_actors_alive`, every
    :data:`WORKER_CHECK_INTERVAL_S` and after every failed sample), and the step makes progress: a sample it had not
    seen finished, within ``run_guard.max_stall_s`` of the step's start, of the last such sample or of the last
    update (``run_guard.max_stall_after_stop_s`` once a stop is requested, counted from the request at the
    earliest). ``buffer`` is verl's replay buffer; its ``partitions`` hold the finished samples by key.
    """

    def __init__(
        self,
        guard: GuardConfig,
        actors: list[tuple[str, list]],
        stop_requested: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.guard, self.actors, self.stop_requested, self.clock = guard, actors, stop_requested, clock
        self.step = 0
        self._seen: set[tuple[str, str]] = set()
        self._progress_at = clock()
        self._stop_at: float | None = None
        self._next_liveness = clock() + WORKER_CHECK_INTERVAL_S

    def progressed(self, step: int) -> None:
        """A step began, or an update ended: the watchdog's clock starts again."""
        if step != self.step:
            self._seen.clear()
        self.step = step
        self._progress_at = self.clock()

    def check(self, buffer: Any, partition_id: str | None, failed: bool = False) -> None:
        now = self.clock()
        partitions = [partition_id] if partition_id is not None else list(buffer.partitions)
        for pid in partitions:
            new = {(pid, key) for key in buffer.partitions[pid]} - self._seen
            if new:
                self._seen |= new
                self._progress_at = now
        waiting_for = f"its {'validation' if partition_id == 'val' else 'train'} samples"
        if failed or now >= self._next_liveness:
            check_actors_alive(self.actors, self.step, waiting_for)
            self._next_liveness = self.clock() + WORKER_CHECK_INTERVAL_S
        if self._stop_at is None and self.stop_requested():
            self._stop_at = now
        stalled = now - self._progress_at
        if (
            self._stop_at is not None
            and now - max(self._progress_at, self._stop_at) > self.guard.max_stall_after_stop_s
        ):
            raise StalledAfterStop(
                f"step {self.step}: stop requested (SIGTERM) while the step waited for {waiting_for}, and no sample "
                f"finished for {now - max(self._progress_at, self._stop_at):.0f} s after it "
                f"({self._state(buffer, partition_id)}) > run_guard.max_stall_after_stop_s="
                f"{self.guard.max_stall_after_stop_s:g}: ended without saving step {self.step} (its update has not "
                "run); a relaunch resumes from the last checkpoint"
            )
        if stalled > self.guard.max_stall_s:
            raise StepStalled(
                f"step {self.step}: no sample finished for {stalled:.0f} s while the step waited for {waiting_for} "
                f"({self._state(buffer, partition_id)}) > run_guard.max_stall_s={self.guard.max_stall_s:g}"
            )

    def _state(self, buffer: Any, partition_id: str | None) -> str:
        pid = partition_id or "train"
        counts = {
            name: len(getattr(buffer, f"{name}_keys", {}).get(pid, ()))
            for name in ("pending", "running", "finished", "failure")
        }
        groups = ", ".join(f"{count} {name}" for name, count in counts.items())
        return f"prompt groups: {groups}; {len(self._seen)} samples finished in this step"


def watch_replay_buffer(buffer: Any, watch: SampleWaitWatch) -> Patch:
    """The patch that makes ``buffer`` (verl 0.9.1's ``ReplayBuffer``, one instance) run ``watch`` after each of
    its polls (``_wait_for_next_poll``, private: its loop in ``sample`` has no other place to stop) and before
    each refill of failed groups (``refill_fn``)."""

    def install(patch: Patch) -> None:
        wait, refill = buffer._wait_for_next_poll, buffer.refill_fn

        def wait_then_watch(partition_id, *args, **kwargs):
            result = wait(partition_id, *args, **kwargs)
            watch.check(buffer, partition_id)
            return result

        patch.replace(buffer, "_wait_for_next_poll", wait_then_watch, "liveness and step-progress watch per poll")
        if refill is not None:

            def watch_then_refill(*args, **kwargs):
                watch.check(buffer, None, failed=True)
                return refill(*args, **kwargs)

            patch.replace(buffer, "refill_fn", watch_then_refill, "a failed sample checks the actors at once")

    return Patch(WATCH_PATCH_NAME, "verl", "0.9.1", install)


WATCH_PATCH_NAME = "watched waits of verl's replay buffer"
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
    by the data loader's position of their prompt (``prompt_order``: uid -> position), then by session and index.

    verl's keys are ``{uid}_{session_id}_{index}``; a key of another form, or a prompt the data loader never gave,
    is an error that names it.
    """

    def rank(key: str) -> tuple[int, int, int]:
        parts = key.split("_")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"sample key {key!r} is not verl's {{uid}}_{{session_id}}_{{index}}")
        if parts[0] not in prompt_order:
            raise ValueError(f"sample key {key!r}: its prompt {parts[0]!r} did not come from the train data loader")
        return prompt_order[parts[0]], int(parts[1]), int(parts[2])

    order = sorted(range(len(batch.keys)), key=lambda i: rank(batch.keys[i]))
    return dataclasses.replace(batch, keys=[batch.keys[i] for i in order], tags=[batch.tags[i] for i in order])


def _trainer_class() -> type:
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from respo_verl.patches import verl_0_9_1
    from respo_verl.run import checkpoint

    class RespoTrainer(PPOTrainerSync):
        """verl's ``PPOTrainerSync`` with the additions of :mod:`respo_verl.run.trainer`."""

        def __init__(self, config, *args, **kwargs):
            guard = GuardConfig.from_config(config.get("run_guard"))
            self._guards = StepGuards(guard)
            # The run's identity before verl adds its own keys (optimizer step counts, TransferQueue) to the config.
            self._run = checkpoint.identity(config)
            verl_0_9_1.FILE_LOGGER_APPEND.apply()
            self._prompt_order: dict[str, int] = {}  # uid -> position, for the train prompts not yet sampled
            self._prompts_fetched = 0
            super().__init__(config, *args, **kwargs)

        def _fetch_one_gen_batch(self):
            batch = super()._fetch_one_gen_batch()
            for uid in batch["uid"]:
                self._prompt_order[str(uid)] = self._prompts_fetched
                self._prompts_fetched += 1
            return batch

        def _load_checkpoint(self):
            plan = checkpoint.plan_resume(self.config, run=self._run)
            for line in plan.warnings:
                logger.warning("respo-verl: %s", line)
                print(f"respo-verl: WARNING: {line}", flush=True)
            if plan.resume_from is not None and self.config.trainer.resume_mode == "auto":
                from omegaconf import open_dict

                with open_dict(self.config.trainer):
                    self.config.trainer.resume_mode = "resume_path"
                    self.config.trainer.resume_from_path = str(plan.resume_from)
                try:
                    return super()._load_checkpoint()
                finally:
                    with open_dict(self.config.trainer):
                        self.config.trainer.resume_mode = "auto"
            return super()._load_checkpoint()

        def on_train_begin(self):
            super().on_train_begin()
            self._watch_sample_waits()
            # verl's Tracking and ReplayBuffer, built by fit() before this hook.
            self._hooks = trainer_hooks(self.logger, self._mark_saved_step, self.replay_buffer, self._in_prompt_order)
            self._hooks.apply()

        def _watch_sample_waits(self) -> None:
            """While the replay buffer waits for a step's samples, watch the actors the step waits on and the
            step's progress (:class:`SampleWaitWatch`); not with ``run_guard.enable=false``."""
            if not self._guards.config.enable:
                return
            request = checkpoint.stop_request(self.config)
            self._watch = SampleWaitWatch(self._guards.config, watched_actors(self), request.is_file)
            self._watch.progressed(self.global_steps)
            self._watch_patch = watch_replay_buffer(self.replay_buffer, self._watch)
            self._watch_patch.apply()

        def on_step_begin(self):
            super().on_step_begin()
            if getattr(self, "_watch", None) is not None:
                self._watch.progressed(self.global_steps)

        def fit(self, *args, **kwargs):
            try:
                return super().fit(*args, **kwargs)
            except RunStopped:
                raise
            except Exception as exc:  # a dead actor the step called, non-finite values: one line naming the step
                stop = stop_for_error(exc, self.global_steps)
                if stop is None:
                    raise
                raise stop from None

        def _in_prompt_order(self, batch):
            """A train batch of the replay buffer in the data loader's order (:func:`in_prompt_order`)."""
            ordered = in_prompt_order(batch, self._prompt_order)
            for key in ordered.keys:  # a prompt is sampled once: forget it (the run may last days)
                self._prompt_order.pop(key.split("_")[0], None)
            return ordered

        def _save_checkpoint(self):
            super()._save_checkpoint()
            self._saved_step = self.global_steps
            # verl logs the step's metrics after its save (and after validation): the marker waits for that line,
            # so that a run killed in between redoes the step from the checkpoint before instead of losing its line.
            self._unmarked_step = self.global_steps

        def _mark_saved_step(self, step) -> None:
            if step is None or getattr(self, "_unmarked_step", None) != step or getattr(self, "_stopping", False):
                return  # a step a guard stopped in is not a step to resume after
            folder = Path(checkpoint.checkpoint_folder(self.config)) / f"global_step_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            checkpoint.write_marker_info(folder, {**self._run, "step": int(step)})
            self._unmarked_step = None

        def on_step_end(self):
            super().on_step_end()
            if getattr(self, "_watch", None) is not None:
                self._watch.progressed(self.global_steps)  # the update has run
            request = checkpoint.stop_request(self.config)
            if request.is_file() and self.global_steps < self.total_training_steps:
                if getattr(self, "_saved_step", None) != self.global_steps:
                    self._save_checkpoint()
                print(
                    f"respo-verl: stop requested ({request}): saved global_step_{self.global_steps}, ending the run",
                    flush=True,
                )
                request.unlink(missing_ok=True)
                self.total_training_steps = self.global_steps  # verl's loop ends after logging this step

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
            n = int(self.config.actor_rollout_ref.rollout.n)
            expected = int(self.config.data.train_batch_size) * n
            evicted = metrics.get(EVICTED_GROUPS_KEY, 0)
            metrics.update(failed_sample_metrics(list(batch.tags), expected, evicted, n))
            try:
                self._guards.check(metrics, global_steps)
            except RunStopped:
                self._log_stopping_step(metrics, global_steps)
                raise

        def _log_stopping_step(self, metrics: dict, step: int) -> None:
            """The step a guard stops in, logged as verl logs every step (its loop never gets to it), marked."""
            self._stopping = True
            data = {key: value for key, value in metrics.items() if key != DAPO_COUNTS_KEY}
            try:
                self.logger.log(data={**data, STOPPED_KEY: 1.0}, step=step)
                self.logger.finish(exit_code=1)  # flushes every backend (wandb, tensorboard, ...) before the raise
            except Exception as exc:  # the stop's own message must still reach the user
                print(f"respo-verl: WARNING: could not log step {step}, the step the run stops in: {exc!r}")

        def _compute_advantage(self, batch, metrics):
            try:
                return super()._compute_advantage(batch, metrics)
            except ValueError as exc:  # e.g. non-finite rewards: verl's message does not say which step
                raise NonFinite(f"step {self.global_steps}: {exc}") from exc

    return RespoTrainer


def _register(patch: Patch) -> None:
    def register() -> None:
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

        register_trainer(TRAINER_MODE)(_trainer_class())
        patch.on_remove(
            lambda: TRAINER_REGISTRY.pop(TRAINER_MODE, None),  # verl's registry has no public unregister
            f"TRAINER_REGISTRY[{TRAINER_MODE!r}]",
            "registered through register_trainer",
        )

    patch.after_import(TRAINER_MODULE, register, "register the respo-verl trainer once verl has its V1 trainers")


REGISTRATION = Patch("respo-verl trainer (trainer_mode respo_sync)", "verl", "0.9.1", _register)
