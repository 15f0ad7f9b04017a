"""The liveness watch of a step's actors on a real Ray: an agent-loop worker whose process ends in the middle of a
rollout is found by the watch's periodic check and named with Ray's cause.

The actors are real Ray actors of a local cluster (one of them ends its own process, as verl's agent-loop worker does
when the kernel's out-of-memory killer ends it mid-rollout); the trainer is a stand-in with the attributes of verl
0.9.1's V1 trainer that :func:`respo_verl.run.watchdog.watched_actors` reads, and the buffer is verl's own
``ReplayBuffer``. A whole run stops the same way when its reward worker is killed (tests/cpu/test_cpu_stops.py, the
failed sample's immediate check); the periodic check's schedule is tested here, with the watch's clock in hand.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from types import SimpleNamespace

import pytest

from respo_verl.run.guards import GuardConfig
from respo_verl.run.launch import PROG
from respo_verl.run.stops import EXIT_ACTOR_DIED, ActorDied, stop_of
from respo_verl.run.watchdog import WORKER_CHECK_INTERVAL_S, SampleWaitWatch, watched_actors

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


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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
    watch = SampleWaitWatch(GuardConfig(max_stall_s=3600), actors, stop_requested=lambda: False, clock=clock)
    watch.progressed(4)
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
