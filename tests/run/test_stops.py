"""How a run that cannot go on stops: the line and exit status the entry point gives each stop, and the watchdog: the
trainer's phase record (with the sample wait on verl's replay buffer) held by the driver against its bounds.

Ray's own exception classes wrap the stops as the driver receives them; the sample wait runs on verl 0.9.1's real
``ReplayBuffer``, and the watchdog with a clock the test moves. The records go through :class:`KV`, a stand-in for
Ray's key-value store (the fast tier starts no Ray; tests/run/test_liveness.py carries them through a real one). End
to end (a killed reward worker, a reward that never returns, a frozen worker): tests/cpu/test_cpu_stops.py and
tests/cpu/test_cpu_hangs.py.
"""

from __future__ import annotations

import random
import re
import string
import time
from pathlib import Path

import pytest
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError, RayTaskError
from support.fakes import KV, Clock

from respo_verl.run.guards import GuardConfig
from respo_verl.run.liveness import WATCH_PATCH_NAME, SampleWait, watch_replay_buffer
from respo_verl.run.stops import (
    EXIT_ACTOR_DIED,
    EXIT_ERROR,
    EXIT_GUARD,
    EXIT_PHASE_STALLED,
    EXIT_STALLED,
    EXIT_STALLED_AFTER_STOP,
    ActorDied,
    NonFinite,
    PhaseStalled,
    RunStopped,
    StalledAfterStop,
    StepStalled,
    actor_role,
    stop_for_error,
    stop_of,
)
from respo_verl.run.watchdog import PhaseBoard, Watchdog

PROG = "respo_verl.main_ppo"
# Ray 2.60's reason for a worker process killed with SIGKILL
KILLED = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
    "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the "
    "worker crashed unexpectedly due to SIGSEGV or another unexpected error."
)


def _actor_died(class_name="RewardLoopWorker", pid=4242) -> ActorDiedError:
    context = ActorDiedErrorContext(
        class_name=class_name, actor_id=b"\x01" * 16, pid=pid, name="reward_loop_worker_0", error_message=KILLED
    )
    return ActorDiedError(context)


def _as_driver_gets_it(exc: BaseException, function: str = "TaskRunner.run") -> BaseException:
    """``exc`` raised in an actor, as ``ray.get`` raises it in the driver: a RayTaskError that is also an instance
    of ``exc``'s class, with Ray's traceback as its text."""
    try:
        raise exc
    except BaseException as raised:
        import traceback

        wrapped = RayTaskError(function, traceback.format_exc(), raised)
        return wrapped.as_instanceof_cause()


@pytest.mark.parametrize(
    ("stop", "status", "what"),
    [
        (RunStopped("step 2: actor/respo/clamp_frac=0.750 > run_guard.max_clamp_share=0.1"), EXIT_GUARD, "run guard"),
        (
            ActorDied("step 3: reward worker 0 of 1 (RewardLoopWorker, pid 7) has died"),
            EXIT_ACTOR_DIED,
            "dead actor",
        ),
        (NonFinite("step 3: token_level_rewards holds non-finite values"), EXIT_GUARD, "non-finite data"),
        (StepStalled("step 1: no sample finished for 61 s"), EXIT_STALLED, "watchdog"),
        (StalledAfterStop("step 1: stop requested (SIGTERM)"), EXIT_STALLED_AFTER_STOP, "watchdog after SIGTERM"),
        (PhaseStalled("step 2: the phase 'update' has run for 31 s"), EXIT_PHASE_STALLED, "watchdog, phase deadline"),
    ],
)
def test_a_stop_raised_in_the_task_runner_is_one_line_with_its_status(stop, status, what):
    got = stop_of(_as_driver_gets_it(stop), PROG)
    assert got.status == status
    assert got.line == f"{PROG}: stopped ({what}, exit {status}): {stop}"
    assert "\n" not in got.line and "Traceback" not in got.line


def test_a_dead_actor_nobody_watched_names_its_class_pid_and_rays_cause():
    # the TaskRunner itself died: the driver's ray.get raises Ray's ActorDiedError as such
    got = stop_of(_actor_died("TaskRunner", 99), PROG)
    assert got.status == EXIT_ACTOR_DIED
    assert got.line == (
        f"{PROG}: stopped (dead actor, exit 4): trainer (TaskRunner, pid 99) died: The actor is dead because its "
        "worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with "
        "a connection error code 2. End of file."
    )


def test_an_unknown_error_is_one_line_then_its_traceback():
    got = stop_of(_as_driver_gets_it(KeyError("actor_rollout_ref")), PROG)
    assert got.status == EXIT_ERROR
    assert got.line == f"{PROG}: stopped (error, exit 1): KeyError: 'actor_rollout_ref' (its traceback follows)"


def test_after_the_stop_line_ray_echoes_no_log_or_error_of_its_workers(capsys, monkeypatch):
    """Ray's own echo on the driver's console, as its log and error threads call it: a worker's traceback printed
    before :func:`end_ray_echo`, nothing after it (lines it held back as repeats included, flushed at shutdown)."""
    import ray._private.worker as ray_worker

    from respo_verl.run.launch import end_ray_echo

    monkeypatch.setattr(ray_worker, "_worker_logs_enabled", True)  # restored after the test: this process's Ray
    # A word of letters only of this test's own: Ray holds back a line it saw lately (its words with digits dropped).
    tag = "".join(random.choices(string.ascii_lowercase, k=16))
    logged = {"lines": [f"Traceback (most recent call last): {tag}"], "pid": 7, "ip": "127.0.0.2", "is_err": True}
    logged.update(job="01000000", actor_name="WorkerDict", task_name="")
    error = {"lines": [f"Raylet is terminated {tag}"], "pid": "raylet", "is_err": False}
    for data in (logged, error):
        ray_worker.print_to_stdstream(dict(data), ignore_prefix=False)
    seen = capsys.readouterr()
    assert f"Traceback (most recent call last): {tag}" in seen.err and f"Raylet is terminated {tag}" in seen.out, seen
    end_ray_echo()
    for data in (logged, error):
        ray_worker.print_to_stdstream(dict(data), ignore_prefix=False)
    for flushed in (ray_worker.stdout_deduplicator.flush(), ray_worker.stderr_deduplicator.flush()):
        for leftover in flushed:
            ray_worker.print_worker_logs(leftover, ray_worker.sys.stderr)
    assert capsys.readouterr() == ("", "")


def test_errors_of_a_step_become_stops_naming_the_step():
    # a ray.get inside the step: the worker group's actor died (Ray raises ActorDiedError as such), or its loss
    # refused non-finite values (Ray wraps the worker's error)
    died = stop_for_error(_actor_died("create_colocated_worker_cls.<locals>.WorkerDict", 5), step=4)
    assert isinstance(died, ActorDied)
    assert str(died).startswith("step 4: update worker (WorkerDict, pid 5) has died while the step "), died
    nan = stop_for_error(
        _as_driver_gets_it(FloatingPointError("log_prob holds non-finite values\nmore"), "WorkerDict.update_actor"), 2
    )
    assert type(nan) is NonFinite and str(nan) == "step 2: FloatingPointError: log_prob holds non-finite values"
    assert stop_for_error(ValueError("something else"), step=1) is None


def _buffer(refill=None):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    return ReplayBuffer("sync", {}, None, "drop", {}, poll_interval=0.0, refill_fn=refill)


def _watchdog(clock, **guard):
    records = KV()
    return PhaseBoard(records), Watchdog(records, GuardConfig(**guard), clock=clock)


def test_the_watchdog_stops_a_step_that_finishes_no_sample_for_its_bound():
    clock, buffer = Clock(), _buffer()
    board, watchdog = _watchdog(clock, max_stall_s=60)
    wait = SampleWait([], board, clock=clock)
    wait.begin(3)
    board.enter(3, "generation", "1 agent-loop worker")
    assert watchdog.check() is None
    buffer.running_keys["train"].update({"uid-a", "uid-b"})
    clock.now += 59
    wait.check(buffer, "train")
    assert watchdog.check() is None
    buffer.partitions["train"]["uid-a_0_0"] = {"status": "success"}  # a sample finished: the clock starts again
    clock.now += 59
    wait.check(buffer, "train")
    assert watchdog.check() is None
    clock.now += 59
    wait.check(buffer, "train")
    assert watchdog.check() is None
    clock.now += 2
    wait.check(buffer, "train")
    stalled = watchdog.check()
    assert isinstance(stalled, StepStalled) and stalled.exit_status == EXIT_STALLED
    assert str(stalled) == (
        "step 3: no sample finished for 61 s while the step waited for its train samples (prompt groups: 0 pending, "
        "2 running, 0 finished, 0 failure; 1 samples finished in this step) > run_guard.max_stall_s=60"
    )
    wait.begin(4)  # the next step starts the clock again
    board.enter(4, "generation", "1 agent-loop worker")
    wait.check(buffer, "train")
    assert watchdog.check() is None


def test_after_sigterm_a_stalled_step_stops_within_the_shorter_bound():
    clock = Clock()
    board, watchdog = _watchdog(clock, max_stall_s=3600, max_stall_after_stop_s=10)
    board.enter(2, "generation", "1 agent-loop worker")
    assert watchdog.check() is None
    clock.now += 500
    assert watchdog.check() is None
    watchdog.request_stop()  # SIGTERM: counted from the request, not from the stall's start
    assert watchdog.check() is None
    clock.now += 10
    assert watchdog.check() is None
    clock.now += 1
    stop = watchdog.check()
    assert isinstance(stop, StalledAfterStop)
    assert re.match(
        r"^step 2: stop requested \(SIGTERM\) .* for 11 s after it .*"
        r"run_guard.max_stall_after_stop_s=10: ended without saving step 2",
        str(stop),
    ), stop


def test_after_sigterm_a_step_that_makes_progress_goes_on_to_save():
    clock, buffer = Clock(), _buffer()
    board, watchdog = _watchdog(clock, max_stall_after_stop_s=10)
    wait = SampleWait([], board, clock=clock)
    wait.begin(1)
    board.enter(1, "generation", "1 agent-loop worker")
    watchdog.request_stop()
    for index in range(5):
        clock.now += 9
        buffer.partitions["train"][f"uid_{index}_0"] = {}
        wait.check(buffer, "train")
        assert watchdog.check() is None


def test_the_patch_runs_the_wait_after_each_poll_and_before_each_refill_and_undoes():
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    refills, checks = [], []
    buffer = _buffer(refill=refills.append)

    class Recording(SampleWait):
        def check(self, buffer, partition_id, failed=False):
            checks.append((partition_id, failed))

    patch = watch_replay_buffer(buffer, Recording([], board=None))
    assert patch.name == WATCH_PATCH_NAME and patch.tested == "0.9.1"
    index = (Path(__file__).resolve().parents[2] / "patches" / "README.md").read_text()
    assert f"| {WATCH_PATCH_NAME} | verl 0.9.1 |" in index  # made per run, so the index test's module scan misses it
    patch.apply()
    buffer._wait_for_next_poll("train", 0.0)
    buffer.refill_fn(2)
    assert checks == [("train", False), (None, True)] and refills == [2]
    patch.remove()
    assert (
        buffer._wait_for_next_poll.__func__ is ReplayBuffer._wait_for_next_poll and buffer.refill_fn == refills.append
    )
    buffer._wait_for_next_poll("train", 0.0)
    assert len(checks) == 2


@pytest.mark.parametrize(
    ("key", "value"), [("max_stall_s", 0), ("max_stall_after_stop_s", -1), ("max_phase_s", 0), ("max_setup_s", 0)]
)
def test_the_watchdog_bounds_must_be_positive(key, value):
    with pytest.raises(ValueError, match=rf"run_guard.{key} must be > 0, got {value}"):
        GuardConfig(**{key: value})


def test_the_presets_bounds_are_the_config_classes_defaults_and_the_cpu_presets_small_ones():
    from omegaconf import OmegaConf

    configs = Path(__file__).resolve().parents[2] / "configs"
    shared = GuardConfig.from_config(OmegaConf.load(configs / "respo_verl" / "run_guard.yaml").run_guard)
    assert shared == GuardConfig() and (shared.max_stall_s, shared.max_phase_s, shared.max_setup_s) == (
        3600,
        1800,
        1800,
    )
    # Both CPU presets take theirs from the file they share (tests/configs/test_device_family.py).
    node = OmegaConf.load(configs / "respo_verl" / "cpu.yaml").run_guard
    cpu = GuardConfig.from_config({**OmegaConf.to_container(node)})
    assert (cpu.max_stall_s, cpu.max_stall_after_stop_s, cpu.max_phase_s, cpu.max_setup_s) == (300, 60, 120, 300)


def test_the_trainers_logger_and_sampler_hooks_act_and_undo(capsys):
    """verl's own Tracking (console) and ReplayBuffer instances. The buffer's ``sample`` needs TransferQueue data, so
    the test first gives the instance a stand-in ``sample`` returning a train and a validation batch; the patch wraps
    whatever ``sample`` the instance has, as it wraps verl's in a run."""
    from types import SimpleNamespace

    from verl.utils.tracking import Tracking

    from respo_verl.run.hooks import HOOKS_PATCH_NAME, trainer_hooks

    logger, buffer = Tracking("p", "e", default_backend="console"), _buffer()
    batches = iter([SimpleNamespace(partition_id="train", keys=["b", "a"]), SimpleNamespace(partition_id="val")])
    buffer.sample = lambda *args, **kwargs: (next(batches), {})
    logged, reordered = [], []
    patch = trainer_hooks(logger, logged.append, buffer, lambda batch: reordered.append(batch) or "in order")
    assert patch.name == HOOKS_PATCH_NAME and patch.tested == "0.9.1"
    index = (Path(__file__).resolve().parents[2] / "patches" / "README.md").read_text()
    assert f"| {HOOKS_PATCH_NAME} | verl 0.9.1 |" in index  # made per run, so the index test's module scan misses it
    stand_in = buffer.sample
    patch.apply()
    logger.log(data={"x": 1.0}, step=3)
    assert logged == [3] and "x:1.0" in capsys.readouterr().out.replace(" ", "")
    assert buffer.sample(1, "train", 2)[0] == "in order" and len(reordered) == 1
    assert buffer.sample(1, "val", 2)[0].partition_id == "val" and len(reordered) == 1  # only train batches
    patch.remove()
    assert buffer.sample is stand_in and logger.log.__func__ is Tracking.log
    logger.log(data={"x": 2.0}, step=4)
    assert logged == [3]


def test_actors_are_named_by_their_role_in_a_run():
    assert actor_role("create_colocated_worker_cls.<locals>.WorkerDict") == "update worker"
    assert actor_role("RewardLoopWorker") == "reward worker"
    assert actor_role("AgentLoopWorkerTQ") == "agent-loop worker"
    assert actor_role("vLLMHttpServer") == "rollout server" and actor_role("CPURolloutServer") == "rollout server"
    assert actor_role("GlobalRequestLoadBalancer") == "rollout load balancer"
    assert actor_role("TaskRunnerV1") == "trainer" and actor_role("SomethingElse") is None
    got = stop_of(_actor_died("SomethingElse", 3), PROG)
    assert "stopped (dead actor, exit 4): SomethingElse, pid 3 died: " in got.line


def test_the_watchdog_stops_a_phase_that_makes_no_progress():
    """The trainer's record (PhaseBoard) and the driver's watchdog, with a clock the test moves: nothing is measured
    before the first record; each change of the record's progress starts the clock again."""
    clock = Clock()
    board, watchdog = _watchdog(clock, max_phase_s=30)
    clock.now += 1000
    assert watchdog.check() is None  # no record yet: the set-up's bound (run_guard.max_setup_s) holds
    board.enter(2, "old log-probs", "1 update worker")
    assert watchdog.check() is None
    clock.now += 29
    board.progress()
    assert watchdog.check() is None
    clock.now += 29
    assert watchdog.check() is None
    with board.phase(2, "update", "1 update worker"):
        assert watchdog.check() is None
        clock.now += 30
        assert watchdog.check() is None  # at the bound, not past it
        clock.now += 1.5
        stop = watchdog.check()
    assert isinstance(stop, PhaseStalled) and stop.exit_status == EXIT_PHASE_STALLED
    assert str(stop) == (
        "step 2: the phase 'update' has run for 31.5 s with no progress > run_guard.max_phase_s=30; it waits on 1 "
        "update worker"
    )
    assert watchdog.check() is None  # the phase ended: the record changed
    board.pause("training ended")
    clock.now += 1000
    assert watchdog.check() is None
    assert watchdog.step == 2  # the step a stop line names, after the trainer's end record too


def test_a_stop_line_names_the_step_the_record_holds_now_not_the_last_one_checked(monkeypatch):
    """A node lost right after step 3 ended: the trainer's record already says step 4, the driver's last check (up to
    an interval ago) still read step 3. The stop line reads the record once more; a Ray that cannot answer leaves the
    last step read."""
    clock = Clock()
    board, watchdog = _watchdog(clock, max_phase_s=30)
    board.enter(3, "update", "1 update worker")
    assert watchdog.check() is None and watchdog.step == 3
    board.enter(4, "generation", "1 agent-loop worker")
    assert watchdog.step == 3 and watchdog.latest_step() == 4 and watchdog.step == 4

    def unreachable(name):
        raise ConnectionError("the GCS is gone")

    board.enter(5, "generation", "1 agent-loop worker")
    monkeypatch.setattr(watchdog.records, "get", unreachable)
    assert watchdog.latest_step() == 4


def test_the_lost_node_check_asks_for_the_step_only_once_a_node_is_lost():
    """The stop of any other error, or of an actor error without Ray connected (this process), reads no record."""
    from respo_verl.run.nodes import lost_node_stop

    asked = []
    assert lost_node_stop(ValueError("not an actor error"), lambda: asked.append(1) or 4) is None
    assert lost_node_stop(_as_driver_gets_it(_actor_died()), lambda: asked.append(1) or 4) is None
    assert asked == []


def _until(condition, timeout=5.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_save_whose_folder_grows_is_progress(tmp_path, monkeypatch):
    """The board measures the folder of a save in progress (on the trainer's node) every check interval."""
    from respo_verl.run import watchdog as module

    monkeypatch.setattr(module, "PHASE_CHECK_INTERVAL_S", 0.01)
    clock = Clock()
    board, watchdog = _watchdog(clock, max_phase_s=30)
    saving = tmp_path / "global_step_3"
    saving.mkdir()
    with board.phase(3, "save", "1 update worker", folder=str(saving)):
        assert watchdog.check() is None
        for part in range(3):
            clock.now += 20
            seq = board.seq
            (saving / f"part{part}").write_bytes(b"x" * 10)
            _until(lambda seq=seq: board.seq > seq)
            assert watchdog.check() is None
        clock.now += 31
        assert "step 3: the phase 'save' has run for 31.0 s" in str(watchdog.check())


def test_after_sigterm_a_stalled_phase_ends_within_the_shorter_bound():
    clock = Clock()
    board, watchdog = _watchdog(clock, max_phase_s=1800, max_stall_after_stop_s=60)
    board.enter(5, "weight sync", "1 update worker, 1 rollout server")
    assert watchdog.check() is None
    clock.now += 100
    watchdog.request_stop()
    clock.now += 60
    assert watchdog.check() is None
    clock.now += 1
    stop = watchdog.check()
    assert isinstance(stop, StalledAfterStop) and stop.exit_status == EXIT_STALLED_AFTER_STOP
    assert str(stop).startswith(
        "step 5: stop requested (SIGTERM) during the phase 'weight sync', and no phase ended and no progress for "
        "61.0 s after it > run_guard.max_stall_after_stop_s=60; it waits on 1 update worker, 1 rollout server: "
        "ended without saving step 5"
    ), stop


def test_the_watchdog_thread_sends_the_stop_request_and_interrupts_with_its_stop(monkeypatch):
    """The thread the driver runs: it carries a SIGTERM's request to the records, a stale record stops it at its
    next check, and it calls ``on_stop`` once."""
    import threading

    from respo_verl.run import watchdog as module

    monkeypatch.setattr(module, "PHASE_CHECK_INTERVAL_S", 0.01)
    clock = Clock()
    board, watchdog = _watchdog(clock, max_phase_s=5)
    board.enter(1, "old log-probs", "2 update workers")
    watchdog.check()
    fired = threading.Event()
    thread = watchdog.start(on_stop=fired.set)
    watchdog.request_stop()
    _until(lambda: board.records.get(module.STOP) == {"signal": "SIGTERM"})
    clock.now += 6
    assert fired.wait(5) and "the phase 'old log-probs'" in str(watchdog.stopped)
    thread.join(5)
    assert not thread.is_alive()
    watchdog.close()


def test_waits_on_counts_the_actors_of_a_phase_by_role():
    """verl's trainer attributes that ``waits_on`` reads, as plain objects (a real trainer needs a whole Ray run:
    tests/cpu/test_cpu_hangs.py names them end to end)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from respo_verl.run.liveness import BETWEEN_PHASES, waits_on
    from respo_verl.run.roles import GENERATION_ACTORS

    actor = SimpleNamespace(world_size=2)
    trainer = SimpleNamespace(
        actor_rollout_wg=actor,
        ref_policy_wg=actor,
        agent_loop_manager=SimpleNamespace(agent_loop_workers=["a"]),
        reward_loop_manager=SimpleNamespace(reward_loop_workers=["r", "r"]),
        llm_server_manager=SimpleNamespace(server_handles=["s"], global_load_balancer="b"),
    )
    assert waits_on(trainer, "update worker", "rollout server") == "2 update workers, 1 rollout server"
    assert waits_on(trainer, "reference worker") == "2 update workers"  # the reference lives in the update workers
    assert waits_on(trainer, *GENERATION_ACTORS) == (
        "1 agent-loop worker, 2 reward workers, 1 rollout server, 1 rollout load balancer"
    )
    assert waits_on(trainer, "critic worker") == BETWEEN_PHASES
    # with verl's config, the rollout servers are named by their engine (a dead vLLM engine hangs a weight sync)
    trainer.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm"}}})
    assert waits_on(trainer, "update worker", "rollout server") == "2 update workers, 1 rollout server (vllm)"
