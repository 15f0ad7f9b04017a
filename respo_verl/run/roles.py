"""The roles of a verl 0.9.1 run: the one table of how verl names, holds and times each kind of actor.

Stop lines, the liveness check, the placement record, the phase record and the watchdog all read their roles from
:data:`ROLES`; a rename in verl is one edit here (tests/run/test_roles.py holds the table against verl's source).
Imports neither verl nor Ray.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

UPDATE_WORKER = "update worker"  # verl's colocated worker: the policy's update, old log-probs, reference
REFERENCE_WORKER = "reference worker"
CRITIC_WORKER = "critic worker"
TRAINER = "trainer"  # verl's TaskRunner: the process the respo-verl trainer runs in
AGENT_LOOP_WORKER = "agent-loop worker"
REWARD_WORKER = "reward worker"
ROLLOUT_SERVER = "rollout server"
LOAD_BALANCER = "rollout load balancer"
VALIDATION = "validation"  # the phase of a step's validation, entered from verl's hooks (it has no timer)


@dataclass(frozen=True)
class Role:
    """One kind of actor of a run."""

    name: str  # as stop lines, the placement record and the phase record say it
    classes: tuple[str, ...] = ()  # the ends of the class names Ray reports for its actors
    attribute: str | None = None  # where verl's V1 trainer holds its actors (a dotted path)
    worker_group: bool = False  # the attribute is a worker group, counted by its world size
    actor_name: re.Pattern | None = None  # verl's names of its actors; the groups number them
    timers: tuple[str, ...] = ()  # the labels of verl's step timers (``marked_timer``) whose phases wait on it
    processes: tuple[str, ...] = ()  # the titles of its processes that are not Ray actors

    def held_by(self, trainer: Any) -> Any:
        """What ``trainer`` holds at :attr:`attribute` (None where it holds nothing there)."""
        if self.attribute is None:
            return None
        held = trainer
        for part in self.attribute.split("."):
            held = getattr(held, part, None)
        return held


ROLES = (
    Role(
        UPDATE_WORKER,
        ("WorkerDict",),
        "actor_rollout_wg",
        worker_group=True,
        actor_name=re.compile(r"_(\d+):(\d+)$"),  # <prefix><class>_<placement group>:<bundle>
        timers=("old_log_prob", "update_actor", "update_weights"),
    ),
    Role(REFERENCE_WORKER, attribute="ref_policy_wg", worker_group=True, timers=("ref",)),
    Role(CRITIC_WORKER, attribute="critic_wg", worker_group=True, timers=("values", "update_critic")),
    Role(TRAINER, ("TaskRunner", "TaskRunnerV1")),
    Role(
        AGENT_LOOP_WORKER,
        ("AgentLoopWorker", "AgentLoopWorkerTQ"),
        "agent_loop_manager.agent_loop_workers",
        timers=("gen",),
    ),
    Role(REWARD_WORKER, ("RewardLoopWorker",), "reward_loop_manager.reward_loop_workers", timers=("gen", "reward")),
    Role(
        ROLLOUT_SERVER,
        ("HttpServer", "RolloutServer"),
        "llm_server_manager.server_handles",
        actor_name=re.compile(r"server_(\d+)_(\d+)"),  # <prefix>server_<replica>_<node rank>
        timers=("gen", "update_weights"),
        processes=("VLLM::EngineCore",),  # vLLM's engine core, a process of its server
    ),
    Role(LOAD_BALANCER, ("LoadBalancer",), "llm_server_manager.global_load_balancer", timers=("gen",)),
    Role("TransferQueue storage", ("StorageUnit",)),
    Role("TransferQueue controller", ("Controller",)),
)
ROLE = {role.name: role for role in ROLES}
# verl's step-timer label -> the phase of a step it times, as the phase record names it.
PHASE_OF_TIMER = {
    "gen": "generation",
    "reward": "reward",
    "old_log_prob": "old log-probs",
    "ref": "reference log-probs",
    "values": "values",
    "update_critic": "critic update",
    "update_actor": "update",
    "update_weights": "weight sync",
}
# verl's timer label -> (the phase, the roles it waits on), for the phase record.
TIMED_PHASES = {
    label: (phase, tuple(role.name for role in ROLES if label in role.timers))
    for label, phase in PHASE_OF_TIMER.items()
}
GENERATION_ACTORS = TIMED_PHASES["gen"][1]  # what generation and validation wait on
# The phases that wait for samples: their progress is a finished sample, their bound run_guard.max_stall_s.
SAMPLE_PHASES = (PHASE_OF_TIMER["gen"], VALIDATION)
# (class-name end, role) for each class an actor of the run may have.
ACTOR_ROLES = tuple((end, role.name) for role in ROLES for end in role.classes)
# The title of a process of the run, at its start: Ray titles an actor's process ``ray::<class>[.<method>]``.
PROCESS_TITLES = re.compile(
    rf"ray::\w*(?:{'|'.join(end for end, _ in ACTOR_ROLES)})\b|"
    + "|".join(re.escape(title) for role in ROLES for title in role.processes)
)


def actor_role(class_name: str) -> str | None:
    """What an actor of class ``class_name`` (as Ray names it) does in a run, or None."""
    short = class_name.rsplit(".", 1)[-1]
    return next((role for end, role in ACTOR_ROLES if short.endswith(end)), None)
