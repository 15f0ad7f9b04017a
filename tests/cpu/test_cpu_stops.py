"""A run that cannot go on stops, end to end on CPU: ``python -m respo_verl.main_ppo algorithm=respo +device=cpu``.

A real subprocess of our entry point (verl's V1 trainer with the respo-verl trainer, Ray, FSDP2 on gloo, the hf_cpu
rollout server), started by tests/support/cpu_runs.py, whose agent-loop worker dies (the liveness watch). The stop is
one line on the driver's stderr with no traceback after it, and an exit status of docs/cluster.md's table.

The agent loop dies in step 4 of a run whose rollout server never receives the trainer's weights, at N = 1: its
first three steps are the negative controls of the weight-sync and log W checks that every other run passes
(tests/support/trainer_checks.py). The run guard's stop (a reward function that raises) ends the R2 run of
test_cpu_megatron.py, the stop on non-finite log-probabilities its R3 run, and the stops of runs that would hang are
in test_cpu_hangs.py. Apart from test_cpu_resume.py and test_cpu_hangs.py so that the files run side by side on two
test workers.
"""

from __future__ import annotations

import pytest
from support import cpu_runs
from support.trainer_checks import ON_POLICY_LOG_W, assert_weights_synced, log_w

from respo_verl.cpu.kit.build import KitSpec, build_kit
from respo_verl.run.stops import EXIT_ACTOR_DIED

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kit():
    return build_kit(KitSpec(), progress=False)


# The stale-server run: N = 1 (one prompt pair per step), lr 1e-2 so that one update moves the actor's log-probs by
# more than the weight-sync bound; the agent loop dies once the prompts of DIES_IN - 1 steps have finished.
PROMPTS_PER_STEP = 2
DIES_IN = 4


@pytest.fixture(scope="module")
def stale_server_run(kit, tmp_path_factory) -> dict:
    """One run whose rollout server ignores the trainer's weights (tests/support/cpu_modules/frozen_rollout.py) and
    whose agent-loop worker dies in step 4 (tests/support/cpu_modules/dying_agent_loop.py); shared by two tests."""
    folder = tmp_path_factory.mktemp("stale_server")
    after = f"+ray_kwargs.ray_init.runtime_env.env_vars.DYING_AGENT_LOOP_AFTER='{PROMPTS_PER_STEP * (DIES_IN - 1)}'"
    command = cpu_runs.command(
        folder / "ckpt",
        1,
        DIES_IN + 1,
        "trainer.save_freq=-1",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "run_guard.sampler_agreement=off",  # the stale server is this run's purpose: its guard would stop it in step 2
        *cpu_runs.extra_modules("frozen_rollout", "dying_agent_loop"),
        after,
    )
    rc, out = cpu_runs.launch(folder, command, timeout=480)
    return {"rc": rc, "out": out, "lines": cpu_runs.log_lines(folder)}


def test_negative_controls_stale_server_weights_and_on_policy_log_w(stale_server_run):
    """N = 1 with a server that ignores weight updates: log W stays 0, and the weight-sync assertion fails."""
    lines = stale_server_run["lines"]
    assert [line["step"] for line in lines] == list(range(1, DIES_IN)), stale_server_run["out"][-4000:]
    assert max(log_w(lines)) < ON_POLICY_LOG_W, log_w(lines)
    with pytest.raises(AssertionError, match="rollout/actor log-prob gap"):
        assert_weights_synced(lines)


def test_an_agent_loop_worker_that_dies_mid_step_stops_the_run(stale_server_run):
    """The agent-loop worker's process dies in the middle of step 4's rollout: its prompts stay "running" and verl's
    replay buffer, which polls for them with no timeout, would wait for ever; the trainer's liveness check of the
    workers stops the run, naming the dead worker and Ray's cause."""
    out = stale_server_run["out"]
    assert stale_server_run["rc"] == EXIT_ACTOR_DIED, out[-4000:]
    cpu_runs.stop_line(
        out,
        rf"\(dead actor, exit {EXIT_ACTOR_DIED}\): step {DIES_IN}: agent-loop worker 0 of 1 \(AgentLoopWorkerTQ, pid "
        r"\d+\) has died while the step waited for its train samples: .+",
    )
    assert [line["step"] for line in stale_server_run["lines"]] == list(range(1, DIES_IN))
