"""Why a run stopped, as one line and an exit status (docs/cluster.md, "Exit status", lists them).

The trainer raises a :class:`RunStopped` (or a subclass) in verl's TaskRunner actor; Ray re-raises it in the
driver wrapped in ``RayTaskError``, with a traceback per process it went through. :func:`stop_of` finds the stop in
that chain, so that the entry point prints its one line first and exits with its status instead of Ray's traceback.
Imports neither verl nor Ray.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from respo_verl.run.roles import actor_role

EXIT_ERROR = 1  # an error the run does not know: the one line, then its traceback
EXIT_REFUSED = 2  # the job was refused before it started (a check of the job, the data, the machine, a node)
EXIT_GUARD = 3  # a run guard on a step's metrics or data (failed samples, a collapsed policy, non-finite values)
EXIT_ACTOR_DIED = 4  # a process the step waits on died (a Ray actor: worker, server, reward worker, ...)
EXIT_STALLED = 5  # the watchdog: generation or validation finished no sample for run_guard.max_stall_s
EXIT_STALLED_AFTER_STOP = 6  # SIGTERM arrived and the step then made no progress for run_guard.max_stall_after_stop_s
EXIT_PHASE_STALLED = 7  # the watchdog: any other phase of a step made no progress for run_guard.max_phase_s

# Ray's error text for a dead actor goes on with advice about every possible cause; the line keeps what happened.
_RAY_ADVICE = re.compile(r"\s*(Some common causes include|There are some potential root causes|Check the).*", re.S)
MAX_CAUSE_CHARS = 600  # a cause longer than this is cut: the line must stay one line a person reads


class RunStopped(RuntimeError):
    """A guard stopped the run; the message names the metric, its value, the bound and the step."""

    exit_status = EXIT_GUARD
    what = "run guard"


class NonFinite(RunStopped):
    """Non-finite values in a step's data (rewards, log-probs); the message names the step and the values."""

    what = "non-finite data"


class ActorDied(RunStopped):
    """A process the step waits on died; the message names its kind, the step and Ray's cause."""

    exit_status = EXIT_ACTOR_DIED
    what = "dead actor"


class StepStalled(RunStopped):
    """Generation or validation finished no sample for the watchdog's bound (the message names the step and it)."""

    exit_status = EXIT_STALLED
    what = "watchdog"


class StalledAfterStop(StepStalled):
    """SIGTERM arrived, and the step then made no progress for the shorter bound."""

    exit_status = EXIT_STALLED_AFTER_STOP
    what = "watchdog after SIGTERM"


class PhaseStalled(RunStopped):
    """Any other phase of a step neither ended nor made progress within the watchdog's phase deadline; the message
    names the step, the phase, the actors it waits on and the bound."""

    exit_status = EXIT_PHASE_STALLED
    what = "watchdog, phase deadline"


@dataclass(frozen=True)
class Stop:
    """What the entry point prints and exits with."""

    line: str
    status: int


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps, outermost first: Ray's ``cause`` of a ``RayTaskError``, then ``__cause__``."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        chain.append(current)
        seen.add(id(current))
        inner = getattr(current, "cause", None)
        current = inner if isinstance(inner, BaseException) else current.__cause__
    return chain


def dead_actor(exc: BaseException) -> tuple[str | None, str, str]:
    """(the dead actor's role or None, its class and pid, Ray's reason in one line) from a Ray ``ActorDiedError``'s
    text, e.g. ``("update worker", "WorkerDict, pid 5", "The actor is dead because ...")``."""
    text = str(exc)
    name = re.search(r"class_name: (\S+)", text)
    pid = re.search(r"\bpid: (\d+)", text)
    short = name[1].rsplit(".", 1)[-1] if name else None
    where = (short or "an actor") + (f", pid {pid[1]}" if pid else "")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("\t")]
    told = [line for line in lines if line != "The actor died unexpectedly before finishing this task."]
    detail = _RAY_ADVICE.sub("", told[0] if told else (lines[0] if lines else type(exc).__name__)).strip()
    return (actor_role(short) if short else None), where, _one_line(detail)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_CAUSE_CHARS else text[: MAX_CAUSE_CHARS - 3] + "..."


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _died(chain: list[BaseException]) -> tuple[str, str] | None:
    """The innermost Ray ``ActorDiedError`` of ``chain`` (:func:`causes`; found by class name: this module imports no
    Ray) as (the dead actor by role, class and pid, e.g. ``update worker (WorkerDict, pid 5)``; Ray's reason in one
    line), or None."""
    died = next((e for e in reversed(chain) if any(c.__name__ == "ActorDiedError" for c in type(e).__mro__)), None)
    if died is None:
        return None
    role, where, reason = dead_actor(died)
    return (f"{role} ({where})" if role else where), reason


def stop_for_error(exc: BaseException, step: int) -> RunStopped | None:
    """The stop for an error that ended a step where no watch was waiting (a ``ray.get`` of the step): a dead Ray
    actor (:class:`ActorDied`, its class, pid and Ray's cause), or non-finite values refused by the loss
    (``FloatingPointError``, :class:`NonFinite`); None for any other error."""
    chain = causes(exc)
    if died := _died(chain):
        who, reason = died
        return ActorDied(f"step {step}: {who} has died while the step waited for it: {reason}")
    inner = next((e for e in reversed(chain) if isinstance(e, FloatingPointError)), None)
    return None if inner is None else NonFinite(f"step {step}: FloatingPointError: {_first_line(inner)}")


def stop_of(exc: BaseException, prog: str) -> Stop:
    """The one line and exit status for ``exc``, an exception that ended the run in the driver: a
    :class:`RunStopped` anywhere in its chain, else a dead Ray actor (the TaskRunner among them), else an error the
    run does not know, whose traceback the caller shows after the line (docs/cluster.md, "Exit status")."""
    chain = causes(exc)
    # innermost first: Ray's wrappers are instances of the class they wrap too, with its traceback as their text
    for inner in reversed(chain):
        if isinstance(inner, RunStopped):
            return Stop(
                f"{prog}: stopped ({inner.what}, exit {inner.exit_status}): {_one_line(str(inner))}", inner.exit_status
            )
    if died := _died(chain):
        who, reason = died
        return Stop(f"{prog}: stopped (dead actor, exit {EXIT_ACTOR_DIED}): {who} died: {reason}", EXIT_ACTOR_DIED)
    innermost = chain[-1]
    return Stop(
        f"{prog}: stopped (error, exit {EXIT_ERROR}): {type(innermost).__name__}: {_one_line(_first_line(innermost))} "
        "(its traceback follows)",
        EXIT_ERROR,
    )
