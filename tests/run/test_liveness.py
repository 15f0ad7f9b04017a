"""On a real Ray: the liveness check of a step's actors (an agent-loop worker whose process ends in the middle of a
rollout is found by the periodic check and named with Ray's cause), and the watchdog's records between processes.

The actors are real Ray actors of a local cluster (one of them ends its own process, as verl's agent-loop worker does
when the kernel's out-of-memory killer ends it mid-rollout); the trainer is a stand-in with the attributes of verl
0.9.1's V1 trainer that :func:`respo_verl.run.liveness.watched_actors` reads, and the buffer is verl's own
``ReplayBuffer``. A whole run stops the same way when its reward worker is killed (tests/cpu/test_cpu_stops.py, the
failed sample's immediate check); the periodic check's schedule is tested here, with the watch's clock in hand.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from types import SimpleNamespace

import pytest
from support.fakes import Clock

from respo_verl.run.guards import GuardConfig
from respo_verl.run.launch import PROG
from respo_verl.run.liveness import WORKER_CHECK_INTERVAL_S, SampleWait, watched_actors
from respo_verl.run.stops import EXIT_ACTOR_DIED, ActorDied, stop_of
from respo_verl.run.watchdog import STOP, PhaseBoard, Records, Watchdog

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_session():
    import ray

    temp = tempfile.mkdtemp(prefix="rv-ray-", dir="/tmp")  # Ray's socket paths must stay short
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_an_agent_loop_worker_that_dies_mid_rollout_is_found_by_the_periodic_check(ray_session):
    ray = ray_session
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    @ray.remote(num_cpus=0)
    class AgentLoopWorker:
        def pid(self) -> int:
            return os.getpid()

        def generate(self) -> None:
            os._exit(1)  # the process ends with its prompts still "running"

    workers = [AgentLoopWorker.remote() for _ in range(2)]
    pids = ray.get([worker.pid.remote() for worker in workers])
    trainer = SimpleNamespace(agent_loop_manager=SimpleNamespace(agent_loop_workers=workers))
    actors = watched_actors(trainer)
    assert actors == [("agent-loop worker", workers)]

    clock = Clock()
    buffer = ReplayBuffer("sync", {}, None, "drop", {}, poll_interval=0.0, refill_fn=None)
    buffer.running_keys["train"].update({"uid-a", "uid-b"})
    watch = SampleWait(actors, PhaseBoard(), clock=clock)
    watch.begin(4)
    clock.now += WORKER_CHECK_INTERVAL_S
    watch.check(buffer, "train")  # both alive: the check passes

    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(workers[1].generate.remote())
    watch.check(buffer, "train")  # the next check is not due yet: the step goes on waiting
    clock.now += WORKER_CHECK_INTERVAL_S
    with pytest.raises(ActorDied) as died:
        watch.check(buffer, "train")
    assert re.fullmatch(
        rf"step 4: agent-loop worker 1 of 2 \(AgentLoopWorker, pid {pids[1]}\) has died while the step waited for its "
        r"train samples: .*worker process has died.*",
        str(died.value),
    ), str(died.value)
    stop = stop_of(died.value, PROG)
    assert stop.status == EXIT_ACTOR_DIED
    assert stop.line == f"{PROG}: stopped (dead actor, exit {EXIT_ACTOR_DIED}): {died.value}"


def test_the_phase_record_and_the_stop_request_cross_processes_through_rays_store(ray_session):
    """The trainer's board in a Ray actor (a process of its own, as verl's TaskRunner, on any node) writes its
    record; the driver's watchdog reads it from Ray's key-value store, and the actor reads the driver's stop
    request there: no file is shared."""
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Trainer:
        def __init__(self) -> None:
            self.records = Records()
            self.board = PhaseBoard(self.records)

        def enter(self, step: int, phase: str) -> int:
            self.board.enter(step, phase, "1 update worker")
            return os.getpid()

        def stop_request(self):
            return self.records.get(STOP)

    trainer = Trainer.remote()
    clock = Clock()
    watchdog = Watchdog(Records(), GuardConfig(max_phase_s=30), clock=clock)
    assert ray.get(trainer.enter.remote(2, "update")) != os.getpid()
    assert watchdog.check() is None
    clock.now += 31
    assert str(watchdog.check()).startswith("step 2: the phase 'update' has run for 31.0 s with no progress")
    assert ray.get(trainer.stop_request.remote()) is None
    stopped = []
    watchdog.start(on_stop=lambda: stopped.append(True))
    watchdog.request_stop()
    for _ in range(100):
        if ray.get(trainer.stop_request.remote()) is not None:
            break
        time.sleep(0.05)
    assert ray.get(trainer.stop_request.remote()) == {"signal": "SIGTERM"}
    watchdog.close()
