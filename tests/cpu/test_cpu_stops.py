"""A run that cannot go on stops, end to end on CPU: ``python -m respo_verl.main_ppo algorithm=respo +device=cpu``.

A real subprocess of our entry point (verl's V1 trainer with the respo-verl trainer, Ray, FSDP2 on gloo, the hf_cpu
rollout server), started by tests/support/cpu_runs.py, whose reward worker is killed with SIGKILL mid-run (the
liveness watch of the actors a step waits on). The stop is one line on the driver's stderr with no traceback after
it, and an exit status of docs/cluster.md's table. verl 0.9.1 would wait for ever: its replay buffer polls for the
step's samples with no timeout, and without the watch verl generated the failed group again and again, a traceback
each time.

The same run's rollout server never receives the trainer's weights, at N = 1: the steps before the kill are the
negative controls of the weight-sync and log W checks that every other run passes (tests/support/trainer_checks.py),
and the agreement guard, set to warn, warns in each of them. An agent-loop worker that dies is found by the same watch
(``check_actors_alive`` over ``watched_actors``) on its periodic check: tests/run/test_liveness.py kills a real Ray
actor under it. The run guard's stop (a reward function that raises) ends the Megatron runs of
test_cpu_megatron_resume.py, the stop on non-finite log-probabilities the vLLM R3 run, and the stops of runs that
would hang are in test_cpu_hangs.py.
"""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest
from support import cpu_runs, procs
from support.trainer_checks import ON_POLICY_LOG_W, assert_weights_synced, log_w

from respo_verl.cpu.kit.build import KitSpec, build_kit
from respo_verl.run.stops import EXIT_ACTOR_DIED

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kit():
    return build_kit(KitSpec(), progress=False)


# N = 1 (one prompt pair per step), lr 1e-2 so that one update moves the actor's log-probs by more than the
# weight-sync bound, and an entropy bonus so that every step updates (a step whose responses all get one reward has
# advantages 0: without the bonus its gradient is 0, and the server would not fall behind). The reward worker is
# killed once KILLED_AFTER steps are logged, so the run stops in the next step or the one after (a step whose rewards
# were all in by then ends as usual).
KILLED_AFTER = 3
ENTROPY_COEFF = 1e-3
STEPS = KILLED_AFTER + 2
# What the agent-loop worker of tests/support/cpu_modules/raising_agent_loop.py raises in its constructor.
RAISED = "raising_agent_loop: this agent-loop worker's constructor raises"


@pytest.fixture(scope="module")
def stale_server_run(kit, tmp_path_factory) -> dict:
    """One run whose rollout server ignores the trainer's weights (tests/support/cpu_modules/frozen_rollout.py) and
    whose RewardLoopWorker is killed with SIGKILL once step 3 is logged (found by the pid the reward function reports,
    tests/support/cpu_modules/announcing_reward.py, and checked to be a process of this run's driver and a reward
    worker); shared by the tests below."""
    folder = tmp_path_factory.mktemp("stale_server")
    killed: dict = {}

    def kill_reward_worker(proc, out: str) -> None:
        if killed or len(cpu_runs.logged_steps(folder / "log.jsonl")) < KILLED_AFTER:
            return
        # the driver scores a response too, before Ray starts: the line must come from the reward worker
        announced = re.search(r"\(RewardLoopWorker pid=(\d+)\)\S* announcing_reward: scoring in pid (\d+)", out)
        assert announced and announced[1] == announced[2], out[-4000:]
        pid = int(announced[1])
        assert procs.descends_from(pid, proc.pid), f"pid {pid} is not a process of this run"
        assert "RewardLoopWorker" in " ".join(psutil.Process(pid).cmdline())
        os.kill(pid, signal.SIGKILL)
        killed.update(pid=pid, at=time.monotonic())

    command = cpu_runs.command(
        folder / "ckpt",
        1,
        STEPS,
        "trainer.save_freq=-1",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        f"actor_rollout_ref.actor.entropy_coeff={ENTROPY_COEFF}",
        # the stale server is this run's purpose: its agreement guard would stop it in step 2, so it warns
        "run_guard.sampler_agreement=warn",
        f"reward.custom_reward_function.path={cpu_runs.FAULTS / 'announcing_reward.py'}",
        *cpu_runs.extra_modules("frozen_rollout"),
    )
    rc, out = cpu_runs.launch(folder, command, timeout=480, while_running=kill_reward_worker)
    ended = time.monotonic()
    return {"rc": rc, "out": out, "lines": cpu_runs.log_lines(folder), "killed": killed, "ended": ended}


def test_negative_controls_stale_server_weights_and_on_policy_log_w(stale_server_run):
    """N = 1 with a server that ignores weight updates: log W stays 0, and the weight-sync assertion fails."""
    lines = stale_server_run["lines"]
    assert [line["step"] for line in lines][:KILLED_AFTER] == list(range(1, KILLED_AFTER + 1)), stale_server_run["out"][
        -4000:
    ]
    assert max(log_w(lines)) < ON_POLICY_LOG_W, log_w(lines)
    grads = [line["data"]["actor/grad_norm"] for line in lines]
    assert all(grad > 0 for grad in grads), f"a step without an update (grad norm per step {grads})"
    with pytest.raises(AssertionError, match="rollout/actor log-prob gap"):
        assert_weights_synced(lines)


def test_the_agreement_guard_set_to_warn_warns_once_per_stale_step_and_counts(stale_server_run):
    """hf_cpu's stale server, the sampler-agreement guard set to warn: step 1 samples with the weights both sides
    start from; from step 2 the server misses every update, and each such step prints one warning line (with the
    metric, its value and the bound) and counts it in the log."""
    logged = [line["step"] for line in stale_server_run["lines"]]
    warned = re.findall(
        r"respo-verl: WARNING: run_guard\.sampler_agreement=warn: step (\d+): training/rollout_probs_diff_max=\S+ > "
        r"run_guard\.max_probs_diff_max=0\.0001: the sampler's token probabilities disagree",
        stale_server_run["out"],
    )
    assert [int(step) for step in warned] == logged[1:], stale_server_run["out"][-4000:]
    counts = {
        line["step"]: line["data"].get("respo_verl/guard_warnings/sampler_agreement")
        for line in stale_server_run["lines"]
    }
    assert counts == {1: None, **{step: float(step - 1) for step in logged[1:]}}, counts


def test_the_runs_reward_worker_killed_mid_run_stops_the_run_within_a_minute(stale_server_run):
    """SIGKILL of the run's RewardLoopWorker once step 3 is logged: the next sample's reward fails, and before verl
    generates its group again the trainer finds the reward worker dead (the failed sample checks the actors at once)
    and stops the run, naming the dead worker and Ray's cause."""
    out, killed = stale_server_run["out"], stale_server_run["killed"]
    assert killed, out[-4000:]
    seconds = stale_server_run["ended"] - killed["at"]
    assert stale_server_run["rc"] == EXIT_ACTOR_DIED, out[-4000:]
    found = cpu_runs.stop_line(
        out,
        rf"\(dead actor, exit {EXIT_ACTOR_DIED}\): step (\d+): reward worker 0 of 1 \(RewardLoopWorker, pid "
        r"(\d+)\) has died while the step waited for its train samples: (.+)",
    )
    step, pid, cause = int(found[1]), int(found[2]), found[3]
    assert pid == killed["pid"] and step in (KILLED_AFTER + 1, KILLED_AFTER + 2), found[0]
    assert "The actor is dead because its worker process has died" in cause, cause
    assert [line["step"] for line in stale_server_run["lines"]] == list(range(1, step)), found[0]
    assert seconds < 60, f"the driver ended {seconds:.0f} s after the kill"
    print(f"reward worker pid {pid} killed; driver exit {stale_server_run['rc']} after {seconds:.1f} s: {found[0]}")


def test_an_agent_loop_worker_whose_constructor_raises_stops_the_set_up_naming_it(kit, tmp_path):
    """verl creates its agent-loop workers at the end of the set-up and calls none of them before the first step; this
    run's one worker raises in its constructor (tests/support/cpu_modules/raising_agent_loop.py, through verl's own
    agent_loop_manager_class). The set-up stops within seconds of the failure, in one line naming the stage, the
    worker and what its constructor raised: the trainer's wait for its actors or the driver's look at the set-up,
    whichever comes first. No step runs."""
    seen: dict = {}

    def note_the_failure(proc, out: str) -> None:
        if "seen" not in seen and RAISED in out:  # Ray echoes the worker's traceback to the driver
            seen["seen"] = time.monotonic()

    command = cpu_runs.command(
        tmp_path / "ckpt",
        1,
        2,
        "trainer.save_freq=-1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=raising_agent_loop.RaisingAgentLoopManager",
        *cpu_runs.extra_modules("raising_agent_loop"),
    )
    rc, out = cpu_runs.launch(tmp_path, command, timeout=420, while_running=note_the_failure)
    ended = time.monotonic()
    assert rc == EXIT_ACTOR_DIED, out[-4000:]
    found = cpu_runs.stop_line(
        out,
        rf"\(dead actor, exit {EXIT_ACTOR_DIED}\): set-up \(the agent loop\): agent-loop worker 0( of 1)? "
        rf"\(RaisingAgentLoopWorker, pid \d+\) has died: its creation task raised RuntimeError: {re.escape(RAISED)} "
        r"\(a test fault\)",
    )
    assert not cpu_runs.logged_steps(tmp_path / "log.jsonl"), out[-4000:]
    # the half-second polls of the output see Ray's echo of the failure; the run ends well within a minute of it
    assert "seen" in seen and ended - seen["seen"] < 60, (seen, ended)
    print(f"the set-up stopped {ended - seen['seen']:.1f} s after the failure was echoed: {found[0]}")
