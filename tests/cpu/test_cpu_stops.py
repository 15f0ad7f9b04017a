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

import re

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
        # the stale server is this run's purpose: its agreement guard would stop it in step 2, so it warns
        "run_guard.sampler_agreement=warn",
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


def test_the_agreement_guard_set_to_warn_warns_once_per_stale_step_and_counts(stale_server_run):
    """hf_cpu's stale server, the sampler-agreement guard set to warn: step 1 samples with the weights both sides
    start from; from step 2 the server misses every update, and each such step prints one warning line (with the
    metric, its value and the bound) and counts it in the log."""
    warned = re.findall(
        r"respo-verl: WARNING: run_guard\.sampler_agreement=warn: step (\d+): training/rollout_probs_diff_max=\S+ > "
        r"run_guard\.max_probs_diff_max=0\.0001: the sampler's token probabilities disagree",
        stale_server_run["out"],
    )
    assert [int(step) for step in warned] == list(range(2, DIES_IN)), stale_server_run["out"][-4000:]
    counts = {
        line["step"]: line["data"].get("respo_verl/guard_warnings/sampler_agreement")
        for line in stale_server_run["lines"]
    }
    assert counts == {1: None, **{step: float(step - 1) for step in range(2, DIES_IN)}}, counts


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
