"""The roles of a verl 0.9.1 run: the one table of how verl names, holds and times each kind of actor, read by the
stop lines, the liveness check, the placement record, the phase record and the watchdog (tests/run/test_roles.py holds
it against verl's source). Imports neither verl nor Ray.
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
    processes: tuple[str, ...] = ()  # the titles of its processes that are not Ray actors

    def held_by(self, trainer: Any) -> Any:
        """What ``trainer`` holds at :attr:`attribute` (None where it holds nothing there)."""
        if self.attribute is None:
            return None
        held = trainer
        for part in self.attribute.split("."):
            held = getattr(held, part, None)
        return held


# name, class-name ends, trainer attribute, worker group, actor names, titles of processes that are no actors
ROLES = (
    Role(UPDATE_WORKER, ("WorkerDict",), "actor_rollout_wg", True, re.compile(r"_(\d+):(\d+)$")),
    Role(REFERENCE_WORKER, (), "ref_policy_wg", True),
    Role(CRITIC_WORKER, (), "critic_wg", True),
    Role(TRAINER, ("TaskRunner", "TaskRunnerV1")),
    Role(AGENT_LOOP_WORKER, ("AgentLoopWorker", "AgentLoopWorkerTQ"), "agent_loop_manager.agent_loop_workers"),
    Role(REWARD_WORKER, ("RewardLoopWorker",), "reward_loop_manager.reward_loop_workers"),
    Role(ROLLOUT_SERVER, ("HttpServer", "RolloutServer"), "llm_server_manager.server_handles", False,
         re.compile(r"server_(\d+)_(\d+)"), ("VLLM::EngineCore",)),  # vLLM's engine core: a process of its server
    Role(LOAD_BALANCER, ("LoadBalancer",), "llm_server_manager.global_load_balancer"),
    Role("TransferQueue storage", ("StorageUnit",)),
    Role("TransferQueue controller", ("Controller",)),
)  # fmt: skip
ROLE = {role.name: role for role in ROLES}
GENERATION_ACTORS = (AGENT_LOOP_WORKER, REWARD_WORKER, ROLLOUT_SERVER, LOAD_BALANCER)  # what samples wait on
# The phases of a step that verl times with ``marked_timer`` (its label -> the phase, the roles it waits on).
TIMED_PHASES = {
    "gen": ("generation", GENERATION_ACTORS),
    "reward": ("reward", (REWARD_WORKER,)),
    "old_log_prob": ("old log-probs", (UPDATE_WORKER,)),
    "ref": ("reference log-probs", (REFERENCE_WORKER,)),
    "values": ("values", (CRITIC_WORKER,)),
    "update_critic": ("critic update", (CRITIC_WORKER,)),
    "update_actor": ("update", (UPDATE_WORKER,)),
    "update_weights": ("weight sync", (UPDATE_WORKER, ROLLOUT_SERVER)),
}
# The phases that wait for samples: their progress is a finished sample, their bound run_guard.max_stall_s.
SAMPLE_PHASES = (TIMED_PHASES["gen"][0], VALIDATION)
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
