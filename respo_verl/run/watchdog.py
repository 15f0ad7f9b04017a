"""The watchdog: the respo-verl trainer's watch over the waits of a step that verl would never end.

While verl's replay buffer waits for a step's samples (verl 0.9.1 polls with no timeout), the actors the step waits
on are checked for life (:func:`watched_actors`: agent-loop and reward workers, rollout servers and their load
balancer), and a step in which no sample finishes for ``run_guard.max_stall_s`` (``max_stall_after_stop_s`` once
SIGTERM has asked for a stop) is stopped (:class:`SampleWaitWatch`, installed on the run's buffer by
:func:`watch_replay_buffer`). Its bounds are keys of :class:`respo_verl.run.guards.GuardConfig`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from respo_verl.patches import Patch
from respo_verl.run.guards import GuardConfig
from respo_verl.run.stops import ActorDied, PhaseStalled, RunStopped, StalledAfterStop, StepStalled, dead_actor

# While a step waits for its samples, how often the actors it waits on are checked for life (one Ray call each, all
# at once); a failed sample (verl then generates its group again) checks them at once.
WORKER_CHECK_INTERVAL_S = 10.0
# A live actor answers its readiness call at once unless its event loop is blocked; longer counts as alive.
WORKER_READY_TIMEOUT_S = 5.0
WATCH_PATCH_NAME = "watched waits of verl's replay buffer"
# The trainer's phase record, next to the stop request in the run's checkpoint folder (which the driver reads too).
PHASE_FILE = "PHASE"
# How often the driver reads the phase record: a phase past its deadline stops the run at most this much later.
PHASE_CHECK_INTERVAL_S = 2.0
# What the trainer waits on between the phases of a step (batch balancing, metrics, TransferQueue's bookkeeping).
BETWEEN_PHASES = "the trainer (TaskRunner) and TransferQueue"


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
        ("reward worker", getattr(reward_loop, "reward_loop_workers", None)),
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
            _, who, reason = dead_actor(exc)
            raise ActorDied(
                f"step {step}: {kind} {index} of {count} ({who}) has died while the step waited for {waiting_for}: "
                f"{reason}"
            ) from None
    check_engines_alive(dict(actors).get("rollout server", []), step, waiting_for)


def engine_dead(server: Any) -> str | None:
    """Run in a rollout server's actor (Ray's ``__ray_call__``): why its inference engine is dead, or None.

    verl's vLLM server keeps vLLM's ``AsyncLLM`` as ``engine``; when vLLM's engine core process dies, the server's
    actor lives on (Ray sees nothing), ``engine.errored`` turns true, and every request fails or waits. A server
    without such an engine (the ``hf_cpu`` server samples in its own process) is never dead this way."""
    engine = getattr(server, "engine", None)
    if engine is None or not getattr(engine, "errored", False):
        return None
    error = getattr(engine, "dead_error", None)
    reason = f"{type(error).__name__}: {error}" if error is not None else "its engine reports an error"
    return f"{type(server).__name__}, {reason}"


def check_engines_alive(servers: list, step: int, waiting_for: str) -> None:
    """Raise :class:`ActorDied` when a rollout server's inference engine has died inside its living actor
    (:func:`engine_dead`). A server busy past :data:`WORKER_READY_TIMEOUT_S` counts as alive: the next check asks
    again."""
    import ray
    from ray.exceptions import RayError

    calls = [(index, h.__ray_call__.remote(engine_dead)) for index, h in enumerate(servers)]
    if not calls:
        return
    ready, _ = ray.wait([ref for _, ref in calls], num_returns=len(calls), timeout=WORKER_READY_TIMEOUT_S)
    for index, ref in calls:
        if ref not in ready:
            continue
        try:
            reason = ray.get(ref)
        except RayError:  # the actor itself died or is unreachable: check_actors_alive names it
            continue
        if reason is not None:
            server, _, error = reason.partition(", ")
            raise ActorDied(
                f"step {step}: rollout server {index} of {len(servers)} ({server}): its inference engine died while "
                f"the step waited for {waiting_for} (the server's actor lives on; a vLLM server's engine core process "
                f"ended): {error}"
            )


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
        on_poll: Callable[[], None] | None = None,
    ) -> None:
        self.guard, self.actors, self.stop_requested, self.clock = guard, actors, stop_requested, clock
        self.on_poll = on_poll  # told after every poll that did not stop the step (the phase deadline's heartbeat)
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
        if self.on_poll is not None:
            self.on_poll()

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


# What generation (and validation) waits on: the kinds of :func:`watched_actors`.
GENERATION_ACTORS = ("agent-loop worker", "reward worker", "rollout server", "rollout load balancer")
# The worker groups of verl's V1 trainer by the role of their actors.
WORKER_GROUPS = {"update worker": "actor_rollout_wg", "reference worker": "ref_policy_wg", "critic worker": "critic_wg"}


def waits_on(trainer: Any, *kinds: str) -> str:
    """The actors of ``kinds`` that ``trainer`` (verl 0.9.1's V1 trainer) has, counted, e.g. ``1 update worker, 1
    rollout server``: worker groups by their world size, the others as :func:`watched_actors` finds them. A
    reference policy that lives in the update workers is counted as them; none found: :data:`BETWEEN_PHASES`."""
    others = dict(watched_actors(trainer))
    counts: dict[str, int] = {}
    for kind in kinds:
        group = getattr(trainer, WORKER_GROUPS[kind], None) if kind in WORKER_GROUPS else None
        if kind == "reference worker" and group is not None and group is getattr(trainer, "actor_rollout_wg", None):
            kind = "update worker"
        count = int(getattr(group, "world_size", 0) or 0) if kind in WORKER_GROUPS else len(others.get(kind, ()))
        if count:
            counts[kind] = max(counts.get(kind, 0), count)
    rollout = _rollout_name(trainer)

    def label(kind: str, n: int) -> str:
        text = f"{n} {kind}{'s' if n != 1 else ''}"
        return f"{text} ({rollout})" if kind == "rollout server" and rollout else text

    return ", ".join(label(kind, n) for kind, n in counts.items()) or BETWEEN_PHASES


def _rollout_name(trainer: Any) -> str | None:
    """The job's rollout engine (``actor_rollout_ref.rollout.name``: vllm, sglang, hf_cpu, ...), or None."""
    try:
        return str(trainer.config.actor_rollout_ref.rollout.name)
    except Exception:  # a trainer without verl's config (tests' stand-ins)
        return None


def phase_file(folder: Path | str) -> Path:
    """The phase record of the run whose checkpoint folder is ``folder``."""
    return Path(folder) / PHASE_FILE


class PhaseBoard:
    """The trainer's side of the phase deadline: which phase of which step runs, and what it waits on.

    Each change (a phase begins or ends, a poll of the sample wait, the save's folder growing) rewrites
    :data:`PHASE_FILE` whole through a temporary file, with a sequence number one higher; the driver's
    :class:`PhaseDeadline` reads it and needs no answer from any actor. ``folder`` in a record names a folder whose
    growth in bytes the driver counts as progress (the checkpoint being saved).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.seq = 0
        self.current: dict[str, Any] = {}

    def enter(self, step: int, phase: str, waits_on: str, folder: Path | str | None = None) -> None:
        self.current = {
            "watched": True,
            "step": int(step),
            "phase": phase,
            "waits_on": waits_on,
            "folder": folder and str(folder),
        }
        self._write()

    def pause(self, why: str) -> None:
        """No deadline until the next phase begins (verl builds the agent loop between the trainer's start-up and
        its first step: start-up has no deadline)."""
        self.current = {"watched": False, "why": why}
        self._write()

    def progress(self) -> None:
        """The phase goes on and made progress (a poll of the watched sample wait)."""
        if self.current:
            self._write()

    def end(self) -> None:
        """Training is over: the deadline no longer applies."""
        self.pause("training ended")

    @contextmanager
    def phase(self, step: int, phase: str, waits_on: str, folder: Path | str | None = None) -> Iterator[None]:
        self.enter(step, phase, waits_on, folder)
        try:
            yield
        finally:
            self.enter(step, f"between phases, after {phase}", BETWEEN_PHASES)

    def _write(self) -> None:
        self.seq += 1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({**self.current, "seq": self.seq, "pid": os.getpid()}) + "\n")
        partial.replace(self.path)


def folder_bytes(folder: str | None) -> int | None:
    """Bytes of the files under ``folder`` (a ``stat`` per file), or None when there is none."""
    if not folder or not os.path.isdir(folder):
        return None
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # a file the save renames or removes while it is counted
                pass
    return total


class PhaseDeadline:
    """The driver's side of the phase deadline: the trainer's phase record (:class:`PhaseBoard`) read every
    :data:`PHASE_CHECK_INTERVAL_S`; when it has not changed (no phase began or ended, no poll of the sample wait,
    the folder being saved did not grow) for ``run_guard.max_phase_s`` by the driver's own clock, the run stops
    (:class:`respo_verl.run.stops.PhaseStalled`); once SIGTERM has asked for a stop (:meth:`request_stop`), after
    ``run_guard.max_stall_after_stop_s`` counted from the later of the request and the last change
    (:class:`respo_verl.run.stops.StalledAfterStop`). Nothing is measured before the trainer's first record, nor
    while a record says it is not watched (start-up, training ended)."""

    def __init__(self, path: Path, guard: GuardConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.guard, self.clock = Path(path), guard, clock
        self.stopped: RunStopped | None = None
        self._record: dict[str, Any] | None = None
        self._state: tuple | None = None
        self._changed_at = clock()
        self._stop_at: float | None = None
        self._done = threading.Event()

    def request_stop(self) -> None:
        if self._stop_at is None:
            self._stop_at = self.clock()

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # unreadable for a moment: the last record read stands
            return self._record

    def check(self) -> RunStopped | None:
        """The stop the record calls for now, or None."""
        now = self.clock()
        record = self._read()
        state = (record or {}).get("seq"), folder_bytes((record or {}).get("folder"))
        if state != self._state:
            self._record, self._state, self._changed_at = record, state, now
        if record is None or not record.get("watched"):
            return None
        step, phase = record.get("step"), record.get("phase")
        waits = f"it waits on {record.get('waits_on')}"
        if self._stop_at is not None:
            quiet = now - max(self._changed_at, self._stop_at)
            if quiet > self.guard.max_stall_after_stop_s:
                return StalledAfterStop(
                    f"step {step}: stop requested (SIGTERM) during the phase '{phase}', and no phase ended and no "
                    f"progress for {quiet:.1f} s after it > run_guard.max_stall_after_stop_s="
                    f"{self.guard.max_stall_after_stop_s:g}; {waits}: ended without saving step {step}; a relaunch "
                    "resumes from the last checkpoint"
                )
        quiet = now - self._changed_at
        if quiet > self.guard.max_phase_s:
            return PhaseStalled(
                f"step {step}: the phase '{phase}' has run for {quiet:.1f} s with no progress > "
                f"run_guard.max_phase_s={self.guard.max_phase_s:g}; {waits}"
            )
        return None

    def start(self, on_stop: Callable[[], None]) -> threading.Thread:
        """Check in a daemon thread until :meth:`close`; on a stop, keep it in :attr:`stopped` and call ``on_stop``
        (the entry point interrupts its main thread, which waits in ``ray.get`` for the trainer)."""

        def loop() -> None:
            while not self._done.wait(PHASE_CHECK_INTERVAL_S):
                stop = self.check()
                if stop is not None:
                    self.stopped = stop
                    on_stop()
                    return

        thread = threading.Thread(target=loop, name="respo-verl phase deadline", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._done.set()
