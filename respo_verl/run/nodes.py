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

from respo_verl.run.checkpoint import checkpoint_folder
from respo_verl.run.stops import ActorDied, actor_role, causes

MARKER = ".respo-verl-nodes"  # the driver's marker in the checkpoint root, read on every node
RAY_ACTOR_ERRORS = ("ActorDiedError", "ActorUnavailableError", "NodeDiedError")
_RANK = re.compile(r"_(\d+):(\d+)$")  # verl's worker actors: <prefix><class>_<placement group>:<bundle>
_SERVER = re.compile(r"server_(\d+)_(\d+)")  # verl's rollout servers: <prefix>server_<replica>_<node rank>


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


def job_roles(job: str | None = None, alive_only: bool = False) -> list[tuple[str, str]]:
    """(role, Ray node id) of each actor of ``job`` (default: this process's job), the trainer first."""
    import ray
    from ray._private import state

    job = job or ray.get_runtime_context().get_job_id()
    actors = [a for a in state.actors().values() if a["JobID"] == job and (a["State"] == "ALIVE" or not alive_only)]
    ranks = sorted((int(m[1]), int(m[2])) for a in actors if (m := _RANK.search(a["Name"] or "")))
    roles, counts = [], {}
    for actor in sorted(actors, key=lambda a: (a["Name"] or "", a["ActorID"])):
        short, name = actor["ActorClassName"].rsplit(".", 1)[-1], actor["Name"] or ""
        role = actor_role(short) or short
        if role == "update worker" and (rank := _RANK.search(name)):
            role += f" rank {ranks.index((int(rank[1]), int(rank[2])))}"
        elif role == "rollout server" and (server := _SERVER.search(name)):
            role += f" {server[1]}" + (f" (node rank {server[2]})" if server[2] != "0" else "")
        elif role != "trainer":
            counts[role] = counts.get(role, -1) + 1
            role += f" {counts[role]}"
        roles.append((role, actor["Address"]["NodeID"]))
    return sorted(roles, key=lambda r: (r[0] != "trainer", r[0]))


def record_placement(job: str | None = None) -> dict[str, str]:
    """Log one line per role of ``job`` (default: this process's) with its node, ``respo_verl placement: <role>: node
    <address> (Ray node <id>)``; return {role: node address}. Call it once the roles exist (the trainer's workers)."""
    import ray

    nodes, placement = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}, {}
    for role, node in job_roles(job, alive_only=True):
        placement[role] = nodes.get(node, "?")
        print(f"respo_verl placement: {role}: node {placement[role]} (Ray node {node[:12]})", flush=True)
    return placement


def _reachable(node: dict) -> bool:
    """Whether the node's raylet is alive for Ray and answers on its port (a lost one refuses at once, before Ray's
    health checks declare it dead)."""
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=2.0):
            return bool(node["Alive"])
    except OSError:
        return False


def lost_node_stop(
    exc: BaseException, step: int | Callable[[], int | None] | None, job: str | None = None
) -> NodeLost | None:
    """The stop for a run that ended with a Ray actor error (or an :class:`ActorDied`) because a node that held
    roles of ``job`` went away: the node (address, Ray node id), its roles and ``step`` (a callable is asked only once
    a node is found lost; default: the step the trainer's :class:`ActorDied` names). None for any other error, when
    Ray is not connected, or when every node of the job is there."""
    import ray

    chain = causes(exc)
    if not any(c.__name__ in RAY_ACTOR_ERRORS or c is ActorDied for e in chain for c in type(e).__mro__):
        return None
    told = [re.match(r"step (\d+): ", str(e)) for e in chain if isinstance(e, ActorDied)]
    told_step = next((int(found[1]) for found in told if found), None)  # the trainer's own stop names its step
    if not ray.is_initialized():
        return None
    try:
        roles, nodes = job_roles(job), {n["NodeID"]: n for n in ray.nodes()}
    except Exception:  # the cluster itself is gone (its head): nothing to name
        return None
    lost = {n: [r for r, at in roles if at == n] for n in {at for _, at in roles} if n in nodes}
    lost = {n: r for n, r in lost.items() if not _reachable(nodes[n])}
    if not lost:
        return None
    step = (step() if callable(step) else step) or told_step
    where = "; ".join(
        f"node {nodes[n]['NodeManagerAddress']} (Ray node {n[:12]}) was lost with {', '.join(roles)}"
        for n, roles in lost.items()
    )
    return NodeLost(
        f"{f'step {step}' if step else 'the run'}: {where}; once the node is back, submit the job again: it resumes "
        "from its last checkpoint"
    )
