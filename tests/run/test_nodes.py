"""The driver's look at its run's Ray cluster (:class:`respo_verl.run.nodes.ClusterWatch`) and the lost-node line,
on a stubbed cluster: rows of Ray's actor table and of ``ray.nodes()`` as Ray 2.60 gives them (the causes of death are
Ray's own protobuf messages), and raylets that are real sockets of this machine, listening or closed. End to end, a
node's raylet SIGKILLed with the trainer on either node: tests/cpu/test_two_nodes.py; an agent-loop worker whose
constructor raises in the set-up: tests/cpu/test_cpu_stops.py.
"""

from __future__ import annotations

import socket

import pytest
from ray.core.generated.common_pb2 import (
    ActorDeathCause,
    ActorDiedErrorContext,
    RayException,
)
from ray.exceptions import ActorDiedError
from support.fakes import KV, Clock

from respo_verl.run import nodes as module
from respo_verl.run.nodes import UNREACHABLE_CHECKS, ClusterWatch, NodeLost, failure, lost_node_stop
from respo_verl.run.stops import EXIT_ACTOR_DIED, EXIT_PHASE_STALLED, ActorDied, PhaseStalled, RunStopped, stop_of
from respo_verl.run.watchdog import PhaseBoard, Watchdog, setup_phase

HEAD, WORKER = "a" * 56, "b" * 56  # Ray node ids
TRACEBACK = (
    'Traceback (most recent call last):\n\n  File "agent_loop.py", line 3, in __init__\n\n'
    "ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task\n"
    "RuntimeError: no TransferQueue controller\n"
)


def _actor(name: str, cls: str, node: str, state: str = "ALIVE", cause: ActorDeathCause | None = None, pid=100):
    row = {"Name": name, "ActorClassName": cls, "ActorID": name.encode().hex(), "State": state, "Pid": pid}
    return {**row, "Address": {"NodeID": node}, "DeathCause": cause}


def _died(reason: str, message: str = "") -> ActorDeathCause:
    context = ActorDiedErrorContext(reason=ActorDiedErrorContext.Reason.Value(reason), error_message=message)
    return ActorDeathCause(actor_died_error_context=context)


def _raised() -> ActorDeathCause:
    return ActorDeathCause(creation_task_failure_context=RayException(formatted_exception_string=TRACEBACK))


def _run_actors() -> list[dict]:
    """A two-node run as verl 0.9.1 places it: the trainer on the head, one update worker rank and one rollout server
    per node."""
    return [
        _actor("", "verl.trainer.main_ppo.TaskRunnerV1", HEAD),
        _actor("abcWorkerDict_0:0", "create_colocated_worker_cls.<locals>.WorkerDict", HEAD),
        _actor("abcWorkerDict_1:0", "create_colocated_worker_cls.<locals>.WorkerDict", WORKER),
        _actor("vllm_server_0_0", "vLLMHttpServer", HEAD),
        _actor("vllm_server_1_0", "vLLMHttpServer", WORKER),
        _actor("agent_loop_worker_0_1a2b", "AgentLoopWorkerTQ", WORKER),
    ]


def _node(node_id: str, port: int, alive: bool = True) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port, "Alive": alive}


@pytest.fixture
def raylets():
    """Two "raylets": the head's port listens, the worker's is closed (nothing listens there: refused at once)."""
    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    yield listening.getsockname()[1], closed_port
    listening.close()


def test_a_raylet_that_listens_is_reachable_a_closed_port_or_a_node_ray_calls_dead_is_not(raylets):
    up, down = raylets
    assert module._reachable(_node(HEAD, up)) is True
    assert module._reachable(_node(WORKER, down)) is False
    assert module._reachable(_node(HEAD, up, alive=False)) is False


def test_a_node_whose_raylet_refuses_twice_in_a_row_is_lost_with_its_roles(raylets):
    up, down = raylets
    ports = {HEAD: up, WORKER: up}
    watch = ClusterWatch(_run_actors, lambda: [_node(n, p) for n, p in ports.items()])
    assert watch.look("step 4", setup=False) == (None, True)  # six actors: more than none
    assert watch.look("step 4", setup=False) == (None, False)
    ports[WORKER] = down
    for _ in range(UNREACHABLE_CHECKS - 1):  # one refused connection is a blip, not a lost node
        assert watch.look("step 4", setup=False) == (None, False)
    ports[WORKER] = up  # it answers again: the count starts over
    assert watch.look("step 4", setup=False) == (None, False)
    ports[WORKER] = down
    for _ in range(UNREACHABLE_CHECKS - 1):
        assert watch.look("step 4", setup=False)[0] is None
    stop, _ = watch.look("step 4", setup=False)
    assert isinstance(stop, NodeLost) and stop.exit_status == EXIT_ACTOR_DIED
    assert str(stop) == (
        f"step 4: node 127.0.0.1 (Ray node {WORKER[:12]}) was lost with agent-loop worker 0, rollout server 1, update "
        "worker rank 1; once the node is back, submit the job again: it resumes from its last checkpoint"
    )


def test_a_node_ray_calls_dead_is_lost_at_the_first_look(raylets):
    up, _ = raylets
    watch = ClusterWatch(_run_actors, lambda: [_node(HEAD, up), _node(WORKER, up, alive=False)])
    stop, _ = watch.look("set-up (the agent loop)", setup=True)
    assert str(stop).startswith(f"set-up (the agent loop): node 127.0.0.1 (Ray node {WORKER[:12]}) was lost with ")


def test_in_the_set_up_an_actor_that_failed_stops_the_run_naming_it_an_orderly_end_does_not(raylets):
    up, _ = raylets
    actors = _run_actors()
    watch = ClusterWatch(lambda: actors, lambda: [_node(HEAD, up), _node(WORKER, up)])
    actors.append(_actor("probe", "NodeProbe", HEAD, "DEAD", _died("OUT_OF_SCOPE", "all references removed")))
    actors.append(_actor("killed", "Killed", HEAD, "DEAD", _died("RAY_KILL", "killed by ray.kill")))
    assert watch.look("set-up (the agent loop)", setup=True) == (None, True)
    actors[-3] = _actor("agent_loop_worker_0_1a2b", "AgentLoopWorkerTQ", WORKER, "DEAD", _raised(), pid=4242)
    assert watch.look("step 1", setup=False) == (None, False)  # in a step, the trainer's own checks name it
    stop, grew = watch.look("set-up (the agent loop)", setup=True)
    assert isinstance(stop, ActorDied) and not grew
    assert str(stop) == (
        "set-up (the agent loop): agent-loop worker 0 (AgentLoopWorkerTQ, pid 4242) has died: its creation task "
        "raised RuntimeError: no TransferQueue controller"
    )


@pytest.mark.parametrize(
    ("cause", "told"),
    [
        (_died("WORKER_DIED", "The actor is dead because its worker process has died."), "WORKER_DIED: The actor is"),
        (_died("NODE_DIED", ""), "NODE_DIED: no message"),
        (None, "it is dead, with no cause in Ray's actor table"),
    ],
)
def test_a_dead_actors_failure_is_told_in_one_line(cause, told):
    assert failure(_actor("x", "X", HEAD, "DEAD", cause)).startswith(told)
    assert failure(_actor("x", "X", HEAD, "RESTARTING", cause)) is None


def _watching(clock, cluster, **guard):
    from respo_verl.run.guards import GuardConfig

    records = KV()
    return PhaseBoard(records), Watchdog(records, GuardConfig(**guard), clock=clock, cluster=cluster)


class Cluster:
    """A :class:`ClusterWatch` stand-in whose answer the test sets; it records what it was asked."""

    def __init__(self) -> None:
        self.stop, self.grew, self.asked = None, False, []

    def look(self, when, setup):
        self.asked.append((when, setup))
        return self.stop, self.grew


def test_the_watchdog_looks_at_the_cluster_every_interval_in_any_phase_and_names_the_step():
    clock, cluster = Clock(), Cluster()
    board, watchdog = _watching(clock, cluster, max_phase_s=1800)
    board.enter(4, "update", "2 update workers")
    assert watchdog.check() is None and cluster.asked == [("step 4", False)]
    clock.now += module.CLUSTER_CHECK_INTERVAL_S - 1
    assert watchdog.check() is None and len(cluster.asked) == 1  # not yet
    clock.now += 1
    cluster.stop = NodeLost("step 4: node 127.0.0.2 (Ray node b) was lost with update worker rank 1")
    assert watchdog.check() is cluster.stop  # long before the update's deadline
    assert stop_of(cluster.stop, "prog").line.startswith("prog: stopped (lost node, exit 4): step 4: node 127.0.0.2")


def test_the_set_up_is_bounded_from_the_drivers_start_its_progress_a_new_stage_or_a_new_actor():
    clock, cluster = Clock(), Cluster()
    board, watchdog = _watching(clock, cluster, max_setup_s=300)
    assert watchdog.check() is None  # no record yet: the TaskRunner starts
    assert cluster.asked == [("set-up (the TaskRunner starts: verl, TransferQueue)", True)]
    clock.now += 250
    board.enter(0, setup_phase("workers, rollout servers, reward loop"), "the trainer (TaskRunner)")
    assert watchdog.check() is None
    clock.now += 250
    cluster.grew = True  # verl created an actor: progress
    assert watchdog.check() is None
    cluster.grew = False
    clock.now += 300
    assert watchdog.check() is None  # at the bound
    clock.now += 5
    stop = watchdog.check()
    assert isinstance(stop, PhaseStalled) and stop.exit_status == EXIT_PHASE_STALLED
    assert str(stop) == (
        "set-up (workers, rollout servers, reward loop): no new stage and no new actor of the run for 305.0 s > "
        "run_guard.max_setup_s=300; it waits on the trainer (TaskRunner)"
    )
    board.enter(1, "generation", "1 agent-loop worker")  # a step: its own bound, and no set-up look
    clock.now += 5
    assert watchdog.check() is None and cluster.asked[-1] == ("step 1", False)


def test_without_a_record_the_first_stage_bound_is_the_set_ups(raylets):
    clock = Clock()
    board, watchdog = _watching(clock, None, max_setup_s=60)
    clock.now += 61
    assert str(watchdog.check()).startswith("set-up (the TaskRunner starts: verl, TransferQueue): no new stage")
    board.pause("training ended")
    clock.now += 1000
    assert watchdog.check() is None


def test_a_surviving_trainers_actor_error_names_the_lost_node_and_the_step_the_trainer_gave(monkeypatch, raylets):
    """The trainer on the head survives the worker; its own stop (a rollout server on the worker died) reaches the
    driver, which finds the worker lost and names it with the trainer's step: the trainer is not among the lost."""
    import ray

    up, down = raylets
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [_node(HEAD, up), _node(WORKER, down)])
    monkeypatch.setattr(module, "job_actors", lambda job=None: _run_actors())
    told = ActorDied("step 4: rollout server 1 of 2 (vLLMHttpServer, pid 7) has died while the step waited")
    stop = lost_node_stop(told, None)
    assert isinstance(stop, NodeLost)
    assert str(stop).startswith(
        f"step 4: node 127.0.0.1 (Ray node {WORKER[:12]}) was lost with agent-loop worker 0, rollout server 1, update "
        "worker rank 1; "
    )
    assert lost_node_stop(ActorDiedError(), lambda: 5).args[0].startswith("step 5: ")
    # the surviving rank's collective fails when its peer goes away: no actor error, the same lost node
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:48853: Connection reset by peer")
    assert str(lost_node_stop(reset, lambda: 3)).startswith(f"step 3: node 127.0.0.1 (Ray node {WORKER[:12]}) was lost")
    assert lost_node_stop(RunStopped("step 3: a guard"), lambda: 3) is None  # a stop of its own names its cause
    monkeypatch.setattr(ray, "nodes", lambda: [_node(HEAD, up), _node(WORKER, up)])
    assert lost_node_stop(told, None) is None  # every node is there: the trainer's own line stands
