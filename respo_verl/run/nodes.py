"""Where a run's roles are on a Ray cluster, what every node must see, and the line for a node that went away.

The roles (the trainer, each update worker rank, each rollout server, ...) are read from Ray's actor table, which
keeps an actor's node after it died: that table is the placement record. What every node must see, for the node
preflight (:func:`respo_verl.run.preflight.check_ray_nodes`): :func:`shared_folders`.
"""

from __future__ import annotations

import re
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from respo_verl.checkpoint import checkpoint_folder
from respo_verl.patches import ray_private
from respo_verl.run.roles import ROLE, ROLLOUT_SERVER, TRAINER, UPDATE_WORKER, actor_role
from respo_verl.run.stops import ActorDied, RunStopped, causes

MARKER = ".respo-verl-nodes"  # the driver's marker in the checkpoint root, read on every node
_RANK, _SERVER = ROLE[UPDATE_WORKER].actor_name, ROLE[ROLLOUT_SERVER].actor_name
# How often the driver looks at its run's nodes and, in the set-up, its actors (:class:`ClusterWatch`): with
# UNREACHABLE_CHECKS, a lost node is named about 10 s after its raylet went away, whatever the trainer waits on.
CLUSTER_CHECK_INTERVAL_S = 5.0
# Looks in a row at which a node's raylet refused or did not answer before the node counts as lost, unless Ray already
# says it is dead: one failed connection (a network blip) must not end a days-long run.
UNREACHABLE_CHECKS = 2
# Ray's reasons for an actor's end that are no failure: its handles went away, or it was killed on purpose.
ORDERLY_ENDS = ("OUT_OF_SCOPE", "REF_DELETED", "RAY_KILL")


class NodeLost(ActorDied):
    """A Ray node that held roles of the run went away; the message names it, its roles and the step."""

    what = "lost node"


@dataclass(frozen=True)
class SharedFolders:
    marker: str  # the driver's marker in the checkpoint root, holding ``token``
    token: str
    data: tuple[tuple[str, int], ...]  # the local data files and their sizes


def shared_folders(config) -> SharedFolders:
    """Write the driver's marker into the run's checkpoint root; with the local data files and their sizes."""
    root, token = checkpoint_folder(config), secrets.token_hex(16)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text(token)
    files = []
    for key in ("data.train_files", "data.val_files"):
        value = OmegaConf.select(config, key, default=None)
        files += [value] if isinstance(value, str) else list(value or ())
    local = [Path(str(f)).resolve() for f in files if "://" not in str(f) and Path(str(f)).is_file()]
    return SharedFolders(str(root / MARKER), token, tuple((str(p), p.stat().st_size) for p in local))


def unseen(folders: SharedFolders) -> list[str]:
    """What this node does not see as the driver does, one phrase each (empty when it sees everything)."""
    marker = Path(folders.marker)
    found = marker.read_text().strip() if marker.is_file() else None
    problems = []
    if found != folders.token:
        why = "is not there" if found is None else "holds another run's token"
        problems.append(f"does not see the checkpoint root {marker.parent} (the driver's marker {marker.name} {why})")
    for path, size in folders.data:
        here = Path(path).stat().st_size if Path(path).is_file() else None
        if here != size:
            problems.append(f"does not see the data file {path}" + ("" if here is None else f" ({here} bytes here)"))
    return problems


def job_actors(job: str | None = None) -> list[dict]:
    """The rows of Ray's actor table (Ray keeps a dead actor's row, its node and its cause of death) of ``job``
    (default: this process's job)."""
    import ray

    job = job or ray.get_runtime_context().get_job_id()
    return [a for a in ray_private.actor_table().values() if a["JobID"] == job]


def named(actors: list[dict], alive_only: bool = False) -> list[tuple[str, dict]]:
    """(role, row) of each of ``actors`` (rows of Ray's actor table: :func:`job_actors`), the trainer first."""
    actors = [a for a in actors if a["State"] == "ALIVE" or not alive_only]
    ranks = sorted((int(m[1]), int(m[2])) for a in actors if (m := _RANK.search(a["Name"] or "")))
    counts: dict[str, int] = {}
    rows = [(_role_of(a, ranks, counts), a) for a in sorted(actors, key=lambda a: (a["Name"] or "", a["ActorID"]))]
    return sorted(rows, key=lambda r: (r[0] != TRAINER, r[0]))


def roles_of(actors: list[dict], alive_only: bool = False) -> list[tuple[str, str]]:
    """(role, Ray node id) of each of ``actors`` (:func:`named`)."""
    return [(role, actor["Address"]["NodeID"]) for role, actor in named(actors, alive_only)]


def _role_of(actor: dict, ranks: list[tuple[int, int]], counts: dict[str, int]) -> str:
    short, name = actor["ActorClassName"].rsplit(".", 1)[-1], actor["Name"] or ""
    role = actor_role(short) or short
    if role == UPDATE_WORKER and (rank := _RANK.search(name)):
        return role + f" rank {ranks.index((int(rank[1]), int(rank[2])))}"
    if role == ROLLOUT_SERVER and (server := _SERVER.search(name)):
        return role + f" {server[1]}" + (f" (node rank {server[2]})" if server[2] != "0" else "")
    if role == TRAINER:
        return role
    counts[role] = counts.get(role, -1) + 1
    return role + f" {counts[role]}"


def record_placement(job: str | None = None) -> dict[str, str]:
    """Log one line per role of ``job`` (default: this process's) with its node, ``respo_verl placement: <role>: node
    <address> (Ray node <id>)``; return {role: node address}. Call it once the roles exist (the trainer's workers)."""
    import ray

    nodes, placement = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}, {}
    for role, node in roles_of(job_actors(job), alive_only=True):
        placement[role] = nodes.get(node, "?")
        print(f"respo_verl placement: {role}: node {placement[role]} (Ray node {node[:12]})", flush=True)
    return placement


def _reachable(node: dict) -> bool:
    """Whether the node's raylet is alive for Ray and answers on its port (a lost one refuses at once, before Ray's
    health checks declare it dead)."""
    if not node.get("Alive"):
        return False
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=2.0):
            return True
    except OSError:
        return False


def _lost_line(when: str, lost: dict[str, list[str]], nodes: dict[str, dict]) -> NodeLost:
    where = "; ".join(
        f"node {nodes[n]['NodeManagerAddress']} (Ray node {n[:12]}) was lost with {', '.join(roles)}"
        for n, roles in lost.items()
    )
    return NodeLost(
        f"{when}: {where}; once the node is back, submit the job again: it resumes from its last checkpoint"
    )


def _nodes_with_roles(roles: list[tuple[str, str]], nodes: dict[str, dict]) -> dict[str, list[str]]:
    """{Ray node id: its roles} of the nodes Ray knows that hold one of ``roles``."""
    return {n: [r for r, at in roles if at == n] for n in dict.fromkeys(at for _, at in roles) if n in nodes}


def lost_node_stop(
    exc: BaseException, step: int | Callable[[], int | None] | None, job: str | None = None
) -> NodeLost | None:
    """The stop for a run that ended with an error while a node that held roles of ``job`` is lost: the node
    (address, Ray node id), its roles and ``step`` (a callable is asked only once a node is found lost; default: the
    step the trainer's :class:`ActorDied` names). Any error counts but a stop of the run's own that names another cause
    (a guard, non-finite data): a dead actor, and as much a collective whose peer went away (gloo's "Connection reset
    by peer" in the surviving rank's update), which is no actor error. None when Ray is not connected, or when every
    node of the job is there."""
    import ray

    chain = causes(exc)
    if any(isinstance(e, RunStopped) and not isinstance(e, ActorDied) for e in chain):
        return None
    told = [re.match(r"step (\d+): ", str(e)) for e in chain if isinstance(e, ActorDied)]
    told_step = next((int(found[1]) for found in told if found), None)  # the trainer's own stop names its step
    if not ray.is_initialized():
        return None
    try:
        roles, nodes = roles_of(job_actors(job)), {n["NodeID"]: n for n in ray.nodes()}
    except Exception:  # the cluster itself is gone (its head): nothing to name
        return None
    lost = {n: r for n, r in _nodes_with_roles(roles, nodes).items() if not _reachable(nodes[n])}
    if not lost:
        return None
    step = (step() if callable(step) else step) or told_step
    return _lost_line(f"step {step}" if step else "the run", lost, nodes)


def failure(actor: dict) -> str | None:
    """Why ``actor`` (a row of Ray's actor table) ended, in one line, when it ended by failing: its creation task
    raised (the exception's last line), it could not be placed, its process or node died. None while it lives or
    restarts, and for an orderly end (its handles went away, ``ray.kill``)."""
    if actor["State"] != "DEAD":
        return None
    cause = actor.get("DeathCause")
    kind = cause.WhichOneof("context") if cause is not None else None
    if kind == "creation_task_failure_context":
        told = [line for line in cause.creation_task_failure_context.formatted_exception_string.splitlines() if line]
        return "its creation task raised " + (told[-1].strip() if told else "an exception")
    if kind == "actor_died_error_context":
        context = cause.actor_died_error_context
        reason = type(context).Reason.Name(context.reason)
        if reason in ORDERLY_ENDS:
            return None
        return f"{reason}: {' '.join(context.error_message.split()) or 'no message'}"
    if kind is None:
        return "it is dead, with no cause in Ray's actor table"
    return " ".join(str(getattr(cause, kind)).split()) or kind


class ClusterWatch:
    """The driver's look at its run's Ray cluster, for the watchdog (:class:`respo_verl.run.watchdog.Watchdog`
    calls :meth:`look` every :data:`CLUSTER_CHECK_INTERVAL_S`), wherever the trainer runs:

    - a node that holds roles of the run and is lost: Ray says it is dead, or its raylet refused or did not answer
      :data:`UNREACHABLE_CHECKS` looks in a row (one failed connection, a network blip, is not a lost node);
    - in the set-up only: an actor of the run that failed (:func:`failure`): nothing waits on an actor that verl
      creates and does not call yet (its agent-loop workers), so the set-up would sit for ever.

    ``actors`` and ``nodes`` return the job's rows of Ray's actor table and ``ray.nodes()``; ``reachable`` asks a
    node's raylet (:func:`_reachable`)."""

    def __init__(
        self,
        actors: Callable[[], list[dict]],
        nodes: Callable[[], list[dict]],
        reachable: Callable[[dict], bool] = _reachable,
    ) -> None:
        self.actors, self.nodes, self.reachable = actors, nodes, reachable
        self.count = 0  # the run's actors seen so far, dead ones included: a new one is set-up's progress
        self._misses: dict[str, int] = {}

    @classmethod
    def of_this_job(cls) -> ClusterWatch:
        import ray

        job = ray.get_runtime_context().get_job_id()
        return cls(lambda: job_actors(job), ray.nodes)

    def look(self, when: str, setup: bool) -> tuple[RunStopped | None, bool]:
        """(the stop the cluster calls for now or None, whether the run has more actors than at the last look).
        ``when`` starts the stop's line (``step 4``, ``set-up (the agent loop)``); ``setup``: the run is in its
        set-up."""
        actors, nodes = self.actors(), {n["NodeID"]: n for n in self.nodes()}
        grew, self.count = len(actors) > self.count, max(self.count, len(actors))
        held = _nodes_with_roles(roles_of(actors), nodes)
        for node in list(self._misses):
            if node not in held:
                del self._misses[node]
        for node in held:
            self._misses[node] = 0 if self.reachable(nodes[node]) else self._misses.get(node, 0) + 1
        lost = {n: r for n, r in held.items() if not nodes[n].get("Alive") or self._misses[n] >= UNREACHABLE_CHECKS}
        if lost:
            return _lost_line(when, lost, nodes), grew
        if setup:
            for role, actor in named(actors):
                if (why := failure(actor)) is not None:
                    who = f"{role} ({actor['ActorClassName'].rsplit('.', 1)[-1]}, pid {actor.get('Pid', '?')})"
                    return ActorDied(f"{when}: {who} has died: {why}"), grew
        return None, grew
