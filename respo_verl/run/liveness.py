"""Inside the trainer's Ray actor: are the actors a step waits on alive, and did its samples progress?

:class:`SampleWait` runs after each poll of verl 0.9.1's replay buffer (:func:`watch_replay_buffer`); it measures
no time: the watchdog, in the driver, holds the phase record against its bounds. The kinds watched and how a death
shows: docs/internals.md, "A process the step waits on that dies".
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

from respo_verl.patches import Patch, ray_private
from respo_verl.run.roles import ROLE, ROLES, ROLLOUT_SERVER, UPDATE_WORKER
from respo_verl.run.stops import ActorDied, dead_actor

# While a step waits for its samples, how often the actors it waits on are checked for life (one Ray call each, all
# at once); a failed sample (verl then generates its group again) checks them at once.
WORKER_CHECK_INTERVAL_S = 10.0
# A live actor answers its readiness call at once unless its event loop is blocked; longer counts as alive.
WORKER_READY_TIMEOUT_S = 5.0
WATCH_PATCH_NAME = "watched waits of verl's replay buffer"
# What the trainer waits on between the phases of a step (batch balancing, metrics, TransferQueue's bookkeeping).
BETWEEN_PHASES = "the trainer (TaskRunner) and TransferQueue"


def watched_actors(trainer: Any) -> list[tuple[str, list]]:
    """The Ray actors a step of verl 0.9.1's V1 trainer waits on while it waits for its samples, by role (those the
    run has). The worker groups and TransferQueue are not here: the step's ``ray.get`` of them raises Ray's
    ``ActorDiedError`` for a dead one (:func:`respo_verl.run.stops.stop_for_error`)."""
    held = [(role.name, role.held_by(trainer)) for role in ROLES if role.attribute and not role.worker_group]
    handles = [(name, list(h) if isinstance(h, (list, tuple)) else [h]) for name, h in held if h is not None]
    return [(name, h) for name, h in handles if h]


def _answered(refs: list) -> list[int]:
    """The indices of ``refs`` (Ray calls) that answered within :data:`WORKER_READY_TIMEOUT_S`; a busy actor counts
    as alive: the next check asks again."""
    import ray

    ready = set(ray.wait(refs, num_returns=len(refs), timeout=WORKER_READY_TIMEOUT_S)[0])
    return [index for index, ref in enumerate(refs) if ref in ready]


def check_actors_alive(actors: list[tuple[str, list]], step: int, waiting_for: str) -> None:
    """Raise :class:`ActorDied` when one of ``actors`` (:func:`watched_actors`) has died (Ray's ``ActorDiedError``
    for its readiness call), or a rollout server's inference engine has (:func:`engine_dead`). One unreachable for a
    moment (``ActorUnavailableError``, a network blip too) counts as alive."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError

    calls = [(kind, index, len(handles), h) for kind, handles in actors for index, h in enumerate(handles)]
    refs = [ray_private.ready(h) for *_, h in calls]
    for number in _answered(refs) if refs else ():
        kind, index, count, _ = calls[number]
        try:
            ray.get(refs[number])
        except ActorUnavailableError:
            continue
        except ActorDiedError as exc:
            _, who, reason = dead_actor(exc)
            raise ActorDied(
                f"step {step}: {kind} {index} of {count} ({who}) has died while the step waited for {waiting_for}: "
                f"{reason}"
            ) from None
    servers = dict(actors).get(ROLLOUT_SERVER, [])
    refs = [ray_private.call(h, engine_dead) for h in servers]
    for index in _answered(refs) if refs else ():
        try:
            reason = ray.get(refs[index])
        except RayError:  # the actor itself died or is unreachable: the readiness call above names it
            continue
        if reason is not None:
            server, _, error = reason.partition(", ")
            raise ActorDied(
                f"step {step}: rollout server {index} of {len(servers)} ({server}): its inference engine died while "
                f"the step waited for {waiting_for} (the server's actor lives on; a vLLM server's engine core process "
                f"ended): {error}"
            )


def await_created(actors: list[tuple[str, list]], when: str) -> None:
    """Wait until each of ``actors`` (:func:`watched_actors`) has been created: the end of the set-up, before the first
    step calls them. One whose creation failed raises :class:`ActorDied`, named with ``when`` (the set-up's stage), its
    role and index, its class and pid, and the line its constructor raised. The wait has no bound of its own: the
    driver's set-up deadline (``run_guard.max_setup_s``) holds it."""
    import ray
    from ray.exceptions import ActorDiedError

    for kind, handles in actors:
        for index, handle in enumerate(handles):
            try:
                ray.get(ray_private.ready(handle))
            except ActorDiedError as exc:
                text = str(exc)
                cls, pid = re.search(r":(\w+)\.__init__\(", text), re.search(r"\bpid=(\d+)", text)
                who = f"{cls[1] if cls else 'an actor'}" + (f", pid {pid[1]}" if pid else "")
                if "creation task" in text:
                    reason = "its creation task raised " + [line.strip() for line in text.splitlines() if line][-1]
                else:
                    reason = dead_actor(exc)[2]
                raise ActorDied(f"{when}: {kind} {index} of {len(handles)} ({who}) has died: {reason}") from None


def engine_dead(server: Any) -> str | None:
    """Run in a rollout server's actor (:func:`respo_verl.patches.ray_private.call`): why its inference engine is
    dead, or None.

    verl's vLLM server keeps vLLM's ``AsyncLLM`` as ``engine``; when vLLM's engine core process dies, the server's
    actor lives on (Ray sees nothing), ``engine.errored`` turns true, and every request fails or waits. A server
    without such an engine (the ``hf_cpu`` server samples in its own process) is never dead this way."""
    engine = getattr(server, "engine", None)
    if engine is None or not getattr(engine, "errored", False):
        return None
    error = getattr(engine, "dead_error", None)
    reason = f"{type(error).__name__}: {error}" if error is not None else "its engine reports an error"
    return f"{type(server).__name__}, {reason}"


class SampleWait:
    """Run after each poll of verl's replay buffer (``buffer``, whose ``partitions`` hold the finished samples by
    key): the actors the step waits on are alive (:func:`check_actors_alive`, every :data:`WORKER_CHECK_INTERVAL_S`
    and after a failed sample), and a newly finished sample is progress, told to ``board`` with the buffer's counts
    (:meth:`respo_verl.run.watchdog.PhaseBoard.progress`)."""

    def __init__(self, actors: list[tuple[str, list]], board: Any, clock: Callable[[], float] = time.monotonic):
        self.actors, self.board, self.clock = actors, board, clock
        self.step = 0
        self._seen: set[tuple[str, str]] = set()
        self._next_liveness = clock() + WORKER_CHECK_INTERVAL_S

    def begin(self, step: int) -> None:
        """A step began: its samples are counted from none."""
        if step != self.step:
            self._seen.clear()
        self.step = step

    def check(self, buffer: Any, partition_id: str | None, failed: bool = False) -> None:
        partitions = [partition_id] if partition_id is not None else list(buffer.partitions)
        new = {(pid, key) for pid in partitions for key in buffer.partitions[pid]} - self._seen
        self._seen |= new
        waiting_for = f"its {'validation' if partition_id == 'val' else 'train'} samples"
        if failed or self.clock() >= self._next_liveness:
            check_actors_alive(self.actors, self.step, waiting_for)
            self._next_liveness = self.clock() + WORKER_CHECK_INTERVAL_S
        self.board.progress(self._state(buffer, partition_id), advanced=bool(new))

    def _state(self, buffer: Any, partition_id: str | None) -> str:
        pid = partition_id or "train"
        groups = ", ".join(
            f"{len(getattr(buffer, f'{name}_keys', {}).get(pid, ()))} {name}"
            for name in ("pending", "running", "finished", "failure")
        )
        return f"prompt groups: {groups}; {len(self._seen)} samples finished in this step"


def watch_replay_buffer(buffer: Any, wait: SampleWait) -> Patch:
    """The patch that makes ``buffer`` (verl 0.9.1's ``ReplayBuffer``, one instance) run ``wait`` after each of
    its polls (``_wait_for_next_poll``, private: its loop in ``sample`` has no other place to stop) and before
    each refill of failed groups (``refill_fn``)."""

    def install(patch: Patch) -> None:
        poll, refill = buffer._wait_for_next_poll, buffer.refill_fn

        def poll_then_check(partition_id, *args, **kwargs):
            result = poll(partition_id, *args, **kwargs)
            wait.check(buffer, partition_id)
            return result

        patch.replace(buffer, "_wait_for_next_poll", poll_then_check, "liveness and sample progress per poll")
        if refill is not None:

            def check_then_refill(*args, **kwargs):
                wait.check(buffer, None, failed=True)
                return refill(*args, **kwargs)

            patch.replace(buffer, "refill_fn", check_then_refill, "a failed sample checks the actors at once")

    return Patch(WATCH_PATCH_NAME, "verl", "0.9.1", install)


def waits_on(trainer: Any, *kinds: str) -> str:
    """The actors of ``kinds`` (roles of :mod:`respo_verl.run.roles`) that ``trainer`` (verl 0.9.1's V1 trainer)
    has, counted, e.g. ``1 update worker, 1 rollout server``: worker groups by their world size, the others as
    :func:`watched_actors` finds them. A worker group that is the update workers' (a reference policy that lives in
    them) is counted as them; none found: :data:`BETWEEN_PHASES`."""
    others, update = dict(watched_actors(trainer)), ROLE[UPDATE_WORKER].held_by(trainer)
    counts: dict[str, int] = {}
    for kind in kinds:
        group = ROLE[kind].held_by(trainer) if ROLE[kind].worker_group else None
        kind = UPDATE_WORKER if group is not None and group is update else kind
        count = int(getattr(group, "world_size", 0) or 0) if ROLE[kind].worker_group else len(others.get(kind, ()))
        if count:
            counts[kind] = max(counts.get(kind, 0), count)
    config = getattr(trainer, "config", None)  # verl's; the tests' stand-ins may have none
    rollout = OmegaConf.select(config, "actor_rollout_ref.rollout.name") if config is not None else None
    engine = f" ({rollout})" if rollout else ""
    labels = [
        f"{n} {kind}{'s' if n != 1 else ''}{engine if kind == ROLLOUT_SERVER else ''}" for kind, n in counts.items()
    ]
    return ", ".join(labels) or BETWEEN_PHASES
