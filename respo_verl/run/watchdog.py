"""The watchdog: the respo-verl trainer's watch over the waits of a step that verl would never end.

While verl's replay buffer waits for a step's samples (verl 0.9.1 polls with no timeout), the actors the step waits
on are checked for life (:func:`watched_actors`: agent-loop and reward-loop workers, rollout servers and their load
balancer), and a step in which no sample finishes for ``run_guard.max_stall_s`` (``max_stall_after_stop_s`` once
SIGTERM has asked for a stop) is stopped (:class:`SampleWaitWatch`, installed on the run's buffer by
:func:`watch_replay_buffer`). Its bounds are keys of :class:`respo_verl.run.guards.GuardConfig`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from respo_verl.patches import Patch
from respo_verl.run.guards import GuardConfig
from respo_verl.run.stops import ActorDied, StalledAfterStop, StepStalled, actor_died_cause

# While a step waits for its samples, how often the actors it waits on are checked for life (one Ray call each, all
# at once); a failed sample (verl then generates its group again) checks them at once.
WORKER_CHECK_INTERVAL_S = 10.0
# A live actor answers its readiness call at once unless its event loop is blocked; longer counts as alive.
WORKER_READY_TIMEOUT_S = 5.0
WATCH_PATCH_NAME = "watched waits of verl's replay buffer"


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
