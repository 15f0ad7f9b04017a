"""TransferQueue 0.1.11: a verl run's TransferQueue controller is its own on a Ray cluster that runs several.

TransferQueue names its controller actor ``TransferQueueController`` in the fixed Ray namespace ``transfer_queue``
(``transfer_queue/interface.py``: ``init`` creates it there and ``_init_from_existing`` looks it up there), so every
verl V1 run on one cluster finds the first run's controller: a second run's TaskRunner attaches to another run's
queue, and once that run has ended, the second run's agent-loop workers find no controller, start one of their own and
collide with their run's storage units (``ActorAlreadyExistsError: The name TransferQueueStorageUnit#0
(namespace=None) is already taken``). The storage units themselves are named in the run's own namespace (a Ray job's,
as they are created without one); the ``RayStorageClient`` backend's ``RayObjectRefStorage`` is named in the same fixed
namespace as the controller.

:data:`PER_RUN_CONTROLLER` replaces that fixed namespace with one of the run's own, :func:`run_namespace`
(``transfer_queue-<Ray job id>``), where these two modules create and look up their named actors: every process of a
run (its driver, TaskRunner, agent-loop workers, trainer and rollout workers) belongs to the Ray job of the run's
driver, so all of them find the run's controller, and two runs alive at once never share a job id. It changes two
names in each module, the module's view of ``ray`` (``get_actor`` in the run's namespace, the rest Ray's own) and
of the actor class (``options`` in the run's namespace, the rest the class's own), and nothing of Ray.

Applied by the plugin (:mod:`respo_verl.verl.plugin`), in every verl process.
Delete when: TransferQueue takes its actors' namespace from its caller, or scopes it to the Ray job itself.
"""

from __future__ import annotations

from typing import Any

from respo_verl.patches import Patch

SHARED_NAMESPACE = "transfer_queue"  # where TransferQueue 0.1.11 names its controller for the whole cluster
# The modules that create and look up actors in SHARED_NAMESPACE, each with its actor class's module-level name.
NAMED_ACTORS = {
    "transfer_queue.interface": "TransferQueueController",
    "transfer_queue.storage.clients.ray_storage_client": "RayObjectRefStorage",
}


def run_namespace() -> str:
    """The run's own namespace for TransferQueue's named actors: ``transfer_queue-<this process's Ray job id>``."""
    import ray

    return f"{SHARED_NAMESPACE}-{ray.get_runtime_context().get_job_id()}"


def _own(namespace: str | None) -> str | None:
    return run_namespace() if namespace == SHARED_NAMESPACE else namespace


class RayOfTheRun:
    """The ``ray`` module as one TransferQueue module sees it: ``get_actor`` looks in the run's namespace where
    TransferQueue names the shared one; every other name is Ray's own."""

    def __init__(self, ray_module: Any) -> None:
        self._ray = ray_module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ray, name)

    def get_actor(self, name: str, namespace: str | None = None) -> Any:
        return self._ray.get_actor(name, namespace=_own(namespace))


class ActorClassOfTheRun:
    """A TransferQueue actor class as its module sees it: ``options`` names the actor in the run's namespace where
    TransferQueue names the shared one; every other name is the class's own."""

    def __init__(self, actor_class: Any) -> None:
        self._actor_class = actor_class

    def __getattr__(self, name: str) -> Any:
        return getattr(self._actor_class, name)

    def options(self, **options: Any) -> Any:
        if "namespace" in options:
            options = {**options, "namespace": _own(options["namespace"])}
        return self._actor_class.options(**options)


def _per_run(patch: Patch) -> None:
    import importlib

    for module_name, actor_class in NAMED_ACTORS.items():

        def wrap(module_name: str = module_name, actor_class: str = actor_class) -> None:
            module = importlib.import_module(module_name)
            why = f"TransferQueue names {actor_class} in the cluster-wide namespace {SHARED_NAMESPACE!r}"
            patch.replace(module, "ray", RayOfTheRun(vars(module)["ray"]), why)
            patch.replace(module, actor_class, ActorClassOfTheRun(vars(module)[actor_class]), why)

        patch.after_import(module_name, wrap, f"{NAMED_ACTORS[module_name]} in the run's own namespace")


PER_RUN_CONTROLLER = Patch("a TransferQueue controller of its own for every run", "TransferQueue", "0.1.11", _per_run)
