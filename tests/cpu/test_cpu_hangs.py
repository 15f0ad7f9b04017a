"""Runs that would hang for ever stop, end to end on CPU: ``python -m respo_verl.main_ppo algorithm=respo +device=cpu``.

Real subprocesses of our entry point, as in test_cpu_stops.py (whose run's reward worker is killed: the liveness
watch of the actors a step waits on): a reward function that never returns (the step-progress watchdog), and the
update worker frozen with SIGSTOP between steps (the watchdog's phase deadline, measured in the driver). verl 0.9.1
would wait for ever in the first (its replay buffer polls for the step's samples with no timeout); in the second,
Ray's keepalive ended the run after 426 s with no phase, step or actor kind named. About 60-120 s each on a 2-core
machine with other jobs.
"""

from __future__ import annotations

import json
import time

import pytest
from support import cpu_runs

from respo_verl.cpu.kit.build import KitSpec, build_kit
from respo_verl.run.launch import WATCHDOG_TRACE_ENV
from respo_verl.run.stops import EXIT_PHASE_STALLED, EXIT_STALLED
from respo_verl.run.watchdog import PHASE_CHECK_INTERVAL_S

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kit():
    return build_kit(KitSpec(), progress=False)


def test_a_step_whose_reward_never_returns_is_stopped_by_the_watchdog(kit, tmp_path):
    """Every reward call blocks for good (tests/support/cpu_modules/stalling_reward.py): every process lives and
    answers Ray, no sample of step 1 ever finishes, and verl would wait for ever; the watchdog stops the run once
    no sample has finished for run_guard.max_stall_s (5 s here, to keep the test short; the CPU preset's 300 s)."""
    command = cpu_runs.command(
        tmp_path / "ckpt",
        2,
        2,
        "trainer.save_freq=-1",
        f"reward.custom_reward_function.path={cpu_runs.FAULTS / 'stalling_reward.py'}",
        "run_guard.max_stall_s=5",
    )
    rc, out = cpu_runs.launch(tmp_path, command, timeout=420)
    assert rc == EXIT_STALLED, out[-4000:]
    assert "stalling_reward: the test's reward function never returns" in out, out[-4000:]
    found = cpu_runs.stop_line(
        out,
        rf"\(watchdog, exit {EXIT_STALLED}\): step 1: no sample finished for (\d+) s while the step waited for its "
        r"train samples \(prompt groups: .*; 0 samples finished in this step\) > run_guard.max_stall_s=5",
    )
    assert 5 <= int(found[1]) <= 20, found[0]
    assert cpu_runs.logged_steps(tmp_path / "log.jsonl") == []
    print(found[0])


# The phase deadline of the frozen-worker run: above the longest healthy phase of a CPU step on a loaded 2-core
# machine (each under a second idle), short enough to keep the test near two minutes.
MAX_PHASE_S = 30


def test_a_frozen_update_worker_is_stopped_by_the_phase_deadline_naming_step_phase_and_actors(
    kit, tmp_path, monkeypatch
):
    """SIGSTOP of the run's update worker (``ray::WorkerDict``, a process of this run's driver) once step 1 is
    logged: a stand-in for a rank stuck in a collective, except that a frozen process stops answering Ray too.
    Step 2's next call into it never returns; the driver's phase deadline, which reads the trainer's phase record and
    asks no actor, stops the run within ``run_guard.max_phase_s`` plus its check interval of the freeze, with exit 7
    and one line naming the step, the phase and the update worker it waits on. The driver's trace of the records it
    read (``RESPO_VERL_WATCHDOG_TRACE``, times on the machine's monotonic clock) dates the record's last change."""
    import psutil

    frozen: dict = {}
    trace = tmp_path / "watchdog.jsonl"
    monkeypatch.setenv(WATCHDOG_TRACE_ENV, str(trace))

    def freeze_update_worker(proc, out: str) -> None:
        if not frozen and cpu_runs.logged_steps(tmp_path / "log.jsonl"):
            workers = [
                p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("ray::WorkerDict")
            ]
            assert len(workers) == 1, [p.name() for p in psutil.Process(proc.pid).children(recursive=True)]
            workers[0].suspend()  # SIGSTOP
            frozen.update(process=workers[0], at=time.monotonic())
        elif frozen and "stopped" not in frozen and cpu_runs.STOP in out:
            frozen["stopped"] = time.monotonic()  # the stop line is out (the launcher looks every 0.5 s)

    command = cpu_runs.command(tmp_path / "ckpt", 2, 3, "trainer.save_freq=-1", f"run_guard.max_phase_s={MAX_PHASE_S}")
    try:
        rc, out = cpu_runs.launch(tmp_path, command, timeout=480, while_running=freeze_update_worker)
    finally:
        if frozen and frozen["process"].is_running():
            frozen["process"].kill()  # a stopped process takes SIGKILL; nothing of the run may outlive the test
    assert frozen, out[-4000:]
    last = json.loads(trace.read_text().splitlines()[-1])  # the record's last change, as the watchdog read it
    assert rc == EXIT_PHASE_STALLED, out[-4000:]
    found = cpu_runs.stop_line(
        out,
        rf"\(watchdog, phase deadline, exit {EXIT_PHASE_STALLED}\): step 2: the phase '([a-z -]+)' has run for "
        rf"([0-9.]+) s with no progress > run_guard.max_phase_s={MAX_PHASE_S}; it waits on (.+)",
    )
    phase, seconds, actors = found[1], float(found[2]), found[3]
    assert phase in ("old log-probs", "update", "weight sync"), found[0]
    assert "1 update worker" in actors, found[0]
    assert MAX_PHASE_S <= seconds <= MAX_PHASE_S + PHASE_CHECK_INTERVAL_S + 1, found[0]
    # within the bound plus the check interval of the record's last change (the launcher looks every 0.5 s)
    quiet = frozen["stopped"] - last["at"]
    assert quiet <= MAX_PHASE_S + PHASE_CHECK_INTERVAL_S + 1.5, f"stop line {quiet:.1f} s after the last change"
    assert last["at"] >= frozen["at"] - 0.5 and last["step"] == 2, last
    assert cpu_runs.logged_steps(tmp_path / "log.jsonl") == [1]
    after = frozen["stopped"] - frozen["at"]
    print(f"update worker frozen; stop line {after:.1f} s later, {quiet:.1f} s after the last phase change: {found[0]}")
