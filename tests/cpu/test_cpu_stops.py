"""Runs that cannot go on stop, end to end on CPU: ``python -m respo_verl.main_ppo algorithm=respo +device=cpu``.

Real subprocesses of our entry point (verl's V1 trainer with the respo-verl trainer, Ray, FSDP2 on gloo, the hf_cpu
rollout server), each stopped in its first step by one fault: a collapsed policy (the run guard), a reward function
that raises (the failed-sample guard), an agent-loop worker that dies (the liveness watch). Each stop is one line on
the driver's stderr with no traceback after it, and an exit status of docs/cluster.md's table. About 80 s each on a
2-core machine with other jobs (load 4-6). Apart from test_cpu_resume.py and test_cpu_hangs.py so that the files run
side by side on two test workers.
"""

from __future__ import annotations

import json

import pytest
from support import cpu_runs

from respo_verl.cpu.kit.build import KitSpec, build_kit
from respo_verl.entry_points import CPU_MODULE, PLUGIN_MODULE
from respo_verl.run.stops import EXIT_ACTOR_DIED, EXIT_GUARD
from respo_verl.tools.runs.logs import STOPPED_KEY, read_log

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kit():
    return build_kit(KitSpec(), progress=False)


def test_a_collapsed_policy_stops_the_run(kit, tmp_path):
    """At lr 1.0 the first updates collapse the policy: log W of a quarter to three quarters of the sequences at its
    clamp (a healthy run shows 0). Which step trips first depends on the machine's arithmetic: step 1 here (0.5 and
    0.75 in two runs), step 2 on the CI machine (0.5); a run of 6 steps that never trips fails the test."""
    command = cpu_runs.command(tmp_path / "ckpt", 2, 6, "actor_rollout_ref.actor.optim.lr=1.0", "trainer.save_freq=-1")
    rc, out = cpu_runs.launch(tmp_path, command)
    assert rc == EXIT_GUARD, out[-4000:]
    guard = rf"\(run guard, exit {EXIT_GUARD}\): "
    tripped = cpu_runs.stop_line(
        out, guard + r"step (\d+): (actor/respo/clamp_frac)=([0-9.]+) > run_guard\.max_clamp_share=.*"
    )
    step, key, shown = int(tripped[1]), tripped[2], tripped[3]
    # Every step up to the stop is in the file log, the last with the metric that tripped the guard, marked as the stop.
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, step + 1)), lines
    data = lines[-1]["data"]
    assert data[STOPPED_KEY] == 1.0 and f"{data[key]:.3f}" == shown and data[key] > 0.1, data
    assert all(STOPPED_KEY not in line["data"] for line in lines[:-1]), lines
    assert read_log(tmp_path / "log.jsonl").stopped_at == step


def test_a_reward_function_that_raises_stops_a_cpu_run_at_the_first_failure(kit, tmp_path):
    """The reward function raises for one response of step 1 (tests/support/cpu_modules/raising_reward.py): verl
    evicts that prompt group and generates it again (training/rollout_failure/evicted_samples), the step's batch is
    full, and only verl's count says that a reward failed. The CPU preset's guard (max_failed_share 0) stops the run
    in step 1, and the step's line, with the failure counted, is in the file log."""
    command = cpu_runs.command(
        tmp_path / "ckpt",
        2,
        2,
        "trainer.save_freq=-1",
        f"reward.custom_reward_function.path={cpu_runs.FAULTS / 'raising_reward.py'}",
    )
    rc, out = cpu_runs.launch(tmp_path, command)
    assert rc == EXIT_GUARD, out[-4000:]
    assert "raising_reward: the test's reward function fails for this response" in out, out[-4000:]
    cpu_runs.stop_line(
        out, rf"\(run guard, exit {EXIT_GUARD}\): step 1: respo_verl/failed_share=.* > run_guard.max_failed_share=0.0"
    )
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1], lines
    data = lines[0]["data"]
    # One group evicted: its n = 4 samples (the CPU preset's n), of the 4 × 4 + 4 the step generated.
    assert data["training/rollout_failure/evicted_samples"] == 1.0, data
    assert data["respo_verl/failed_samples"] == 4.0 and data["respo_verl/failed_share"] == 0.2, data
    assert data[STOPPED_KEY] == 1.0, data


def test_an_agent_loop_worker_that_dies_mid_step_stops_the_run(kit, tmp_path):
    """The agent-loop worker's process dies in the middle of step 1's rollout (tests/cpu/modules/dying_agent_loop.py):
    its prompts stay "running" and verl's replay buffer, which polls for them with no timeout, would wait for ever;
    the trainer's liveness check of the workers stops the run, naming the dead worker and Ray's cause."""
    modules = f"{PLUGIN_MODULE},{CPU_MODULE},dying_agent_loop"
    command = cpu_runs.command(
        tmp_path / "ckpt",
        2,
        2,
        "trainer.save_freq=-1",
        f"ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='{modules}'",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH={cpu_runs.MODULES}",
    )
    rc, out = cpu_runs.launch(tmp_path, command, timeout=420)
    assert rc == EXIT_ACTOR_DIED, out[-4000:]
    cpu_runs.stop_line(
        out,
        rf"\(dead actor, exit {EXIT_ACTOR_DIED}\): step 1: agent-loop worker 0 of 1 \(AgentLoopWorkerTQ, pid \d+\) "
        r"has died while the step waited for its train samples: .+",
    )
    assert cpu_runs.logged_steps(tmp_path / "log.jsonl") == []
