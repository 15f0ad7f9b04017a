"""An agent loop whose worker's constructor raises, for the set-up's stop (tests/cpu/test_cpu_stops.py).

Selected through verl 0.9.1's own seam, ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``: verl's
TaskRunner builds this manager after the trainer's set-up, and it creates its workers without calling them, as
verl's own manager does; each worker's creation task raises :data:`MESSAGE`.
"""

import ray
from verl.trainer.ppo.v1 import AgentLoopManagerTQ

MESSAGE = "raising_agent_loop: this agent-loop worker's constructor raises (a test fault)"


@ray.remote
class RaisingAgentLoopWorker:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(MESSAGE)


class RaisingAgentLoopManager(AgentLoopManagerTQ):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = RaisingAgentLoopWorker
