"""A run that survives pre-emption, end to end on CPU: ``python -m respo_verl.main_ppo algorithm=respo +device=cpu``.

Real subprocesses of our entry point with verl's V1 trainer (the respo-verl trainer registered in it), Ray, FSDP2 on
gloo and the hf_cpu rollout server; nothing is mocked. Against one uninterrupted run of the command (shared by the
module): a run walked through a pre-emption notice (SIGTERM to the driver), its relaunch, and a relaunch of another
configuration into the same folder; a run whose driver is killed with SIGKILL after its periodic checkpoint of step
2, whose Ray processes must then be gone within the reaper's bound, and its relaunch. Two more stop a run: a
collapsed policy, and an agent-loop worker that dies in the middle of a step. 13 minutes together on a 2-core
machine shared with other jobs (load average 4-6: 582 s for the uninterrupted, SIGTERM and SIGKILL runs, 185 s for
the other two). One more stops at a reward function that raises (81 s on the same machine, measured apart).

The runs use verl's ``rollout.full_determinism``: the CPU rollout server then samples each request from (seed, step,
request id), the trainer orders each step's samples by the data loader, and two fresh runs log the same metrics: the
resumed run can be compared with the uninterrupted one step by step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.trainer_checks import RESPO_KEYS, STALE_LOG_W, assert_trains, assert_weights_synced, log_w

from respo_verl.cpu.kit.build import KitSpec, build_kit, kit_root
from respo_verl.entry_points import CPU_MODULE, PLUGIN_MODULE
from respo_verl.tools.runs.logs import STOPPED_KEY, read_log
from respo_verl.verl.checkpoint import MARKER, TRACKER
from respo_verl.verl.reaper import REAP_BOUND_S

pytestmark = pytest.mark.slow
MODULES = Path(__file__).resolve().parent / "modules"  # test-only modules loaded in every Ray process of a run


@pytest.fixture(scope="module")
def kit():
    return build_kit(KitSpec(), progress=False)


def _env(log: Path) -> dict[str, str]:
    return {
        **os.environ,
        "VERL_FILE_LOGGER_PATH": str(log),
        "RESPO_VERL_CPU_KIT": str(kit_root()),
        "HF_HUB_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
        "TORCH_COMPILE_DISABLE": "1",
    }


def _command(folder: Path, reuse: int, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "respo_verl.main_ppo",
        "algorithm=respo",
        "+device=cpu",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"data.train_batch_size={2 * reuse}",
        f"trainer.total_training_steps={steps}",
        "trainer.experiment_name=resume",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={folder}",
        *extra,
    ]


def _start(tmp_path: Path, command: list[str], ray_tmp: str, log: Path, out) -> subprocess.Popen:
    """Start ``command`` in ``tmp_path`` with its Ray temp dir, its file logger at ``log`` and its output to ``out``."""
    return subprocess.Popen(
        [*command, f"+ray_kwargs.ray_init._temp_dir={ray_tmp}"],
        cwd=tmp_path,
        env=_env(log),
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def _launch(tmp_path: Path, command: list[str], sigterm_after_step: int | None = None, timeout: float = 600):
    """Run ``command`` (a Ray temp dir of its own); with ``sigterm_after_step``, send the driver SIGTERM as soon as
    the log holds that step. Returns (returncode, output)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "log.jsonl"
    ray_tmp = tempfile.mkdtemp(prefix="rv-ray-", dir="/tmp")  # Ray's socket paths must stay short
    out_path = tmp_path / f"out-{time.monotonic_ns()}.txt"
    try:
        with out_path.open("w") as out:
            proc = _start(tmp_path, command, ray_tmp, log, out)
            deadline = time.monotonic() + timeout
            signalled = sigterm_after_step is None
            while proc.poll() is None and time.monotonic() < deadline:
                if not signalled and _logged_steps(log) and max(_logged_steps(log)) >= sigterm_after_step:
                    proc.send_signal(signal.SIGTERM)
                    signalled = True
                time.sleep(0.5)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                pytest.fail(f"{command} did not end within {timeout} s")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return proc.returncode, out_path.read_text(errors="replace")


def _refused_in_process(tmp_path: Path, command: list[str]):
    """``command`` (a ``python -m respo_verl.main_ppo`` line) run in this process, for a refusal before Ray."""
    import ray
    from support.entry import run_entry

    assert command[1:3] == ["-m", "respo_verl.main_ppo"], command
    env = {"VERL_FILE_LOGGER_PATH": str(tmp_path / "log.jsonl"), "RESPO_VERL_CPU_KIT": str(kit_root())}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    init = ray.init
    try:
        ray.init = _no_ray  # a refusal that stopped working must not start a cluster in the test's process
        return run_entry(command[3:], tmp_path)
    finally:
        ray.init = init
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _no_ray(*args, **kwargs):
    raise AssertionError("the job was not refused before Ray: it reached ray.init")


def _logged_steps(log: Path) -> list[int]:
    if not log.is_file():
        return []
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip().endswith("}")]
    return [r["step"] for r in records if "step" in r]


# Wall-clock figures are left out; every other metric must be equal to the last bit: the trainer puts each step's
# samples in the data loader's order, so no sum over a batch depends on the order in which the rollouts finished.
_UNTIMED = ("timing_s/", "timing_per_token_ms/", "perf/")


def _metrics_by_step(log: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return {r["step"]: r["data"] for r in records if "step" in r}


def _assert_same_metrics(resumed: dict[int, dict], reference: dict[int, dict]) -> None:
    assert sorted(resumed) == sorted(reference)
    for step, ref in reference.items():
        got = resumed[step]
        keys = {k for k in ref if not any(part in k for part in _UNTIMED)}
        assert keys == {k for k in got if not any(part in k for part in _UNTIMED)}, step
        for key in sorted(keys):
            assert got[key] == ref[key], (step, key, got[key], ref[key])


def _final_weights(folder: Path, step: int) -> dict:
    import torch

    files = sorted((folder / f"global_step_{step}" / "actor").glob("model_world_size_*_rank_*.pt"))
    assert files, list((folder / f"global_step_{step}").rglob("*"))
    return {f.name: torch.load(f, map_location="cpu", weights_only=False) for f in files}


DETERMINISTIC = "actor_rollout_ref.rollout.full_determinism=true"


# Rollout reuse N of the uninterrupted run and of the runs resumed against it.
REUSE = 4


@pytest.fixture(scope="module")
def uninterrupted(kit, tmp_path_factory) -> Path:
    """The folder of one uninterrupted 4-step run (its log.jsonl and ckpt/): ReSPO at N = 4 through our entry point,
    the reference of the resumed runs. A run that fails fails every test that reads it, with its own output."""
    reference = tmp_path_factory.mktemp("uninterrupted")
    rc, out = _launch(reference, _command(reference / "ckpt", REUSE, 4, "trainer.save_freq=3", DETERMINISTIC))
    if rc != 0:
        pytest.fail(f"the uninterrupted reference run failed with exit status {rc}:\n{out[-4000:]}", pytrace=False)
    return reference


def test_respo_with_our_entry_point_trains_with_rollout_reuse(uninterrupted):
    lines = [json.loads(line) for line in (uninterrupted / "log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        missing = [k for k in RESPO_KEYS if k not in line["data"]]
        assert not missing, f"step {line['step']} lacks {missing}"
    assert_trains(lines)
    assert_weights_synced(lines)
    # N = 4: mini-batches 2..4 of every rollout batch are off-policy, and ReSPO's metrics see it.
    assert max(log_w(lines)) > STALE_LOG_W, log_w(lines)


def _assert_resumed_exactly(run: Path, reference: Path, resumed_from: int) -> None:
    """Every step's metrics, and the final weights, are those of the uninterrupted run, which trained after
    ``resumed_from`` (a run without gradients would leave the weights and the optimizer's moments untested)."""
    expected = _metrics_by_step(reference / "log.jsonl")
    trained = [step for step, data in expected.items() if step > resumed_from and data["actor/grad_norm"] > 0]
    assert trained, {step: data["actor/grad_norm"] for step, data in expected.items()}
    _assert_same_metrics(_metrics_by_step(run / "log.jsonl"), expected)
    resumed_weights, reference_weights = _final_weights(run / "ckpt", 4), _final_weights(reference / "ckpt", 4)
    assert resumed_weights.keys() == reference_weights.keys()
    for name, state in reference_weights.items():
        assert state.keys() == resumed_weights[name].keys()
        for key, tensor in state.items():
            assert torch_equal(resumed_weights[name][key], tensor), (name, key)


def test_sigterm_saves_and_stops_the_relaunch_resumes_exactly_another_run_is_refused(uninterrupted, tmp_path):
    folder = tmp_path / "ckpt"
    # save_freq 3: the checkpoint at step 2 exists only because the pre-emption notice asked for it
    command = _command(folder, REUSE, 4, "trainer.save_freq=3", DETERMINISTIC)

    rc, out = _launch(tmp_path, command, sigterm_after_step=1)
    assert rc == 0, out[-4000:]
    assert "SIGTERM: the trainer saves at the end of this step" in out
    stopped = max(_logged_steps(tmp_path / "log.jsonl"))
    assert stopped in (1, 2), out[-4000:]  # the step the notice arrived in, or the next one
    assert f"stop requested ({folder / 'STOP'}): saved global_step_{stopped}, ending the run" in out
    assert (folder / f"global_step_{stopped}" / MARKER).is_file()
    assert (folder / TRACKER).read_text().strip() == str(stopped)
    assert not (folder / "STOP").exists()

    rc, out = _launch(tmp_path, command)
    assert rc == 0, out[-4000:]
    assert f"global_step_{stopped}" in out and "Resuming from" in out, out[-4000:]
    log = read_log(tmp_path / "log.jsonl")
    assert log.attempts == 2 and log.complete_through(4), (log.steps, log.continuity)
    assert log.continuity == [] and log.steps == [1, 2, 3, 4]
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [line.get("event") for line in lines] == [None] * stopped + ["resume"] + [None] * (4 - stopped)
    assert (folder / "global_step_4" / MARKER).is_file()

    _assert_resumed_exactly(tmp_path, uninterrupted, stopped)

    # Another configuration (N = 1) launched into the same folder: refused before Ray starts, naming both. The
    # refusal needs no process of its own: the entry point runs in this one (Ray is not started when it refuses).
    refused = _refused_in_process(tmp_path, _command(folder, 1, 4, "trainer.save_freq=3"))
    out = refused.stdout + refused.stderr
    assert refused.returncode == 2, out[-4000:]
    assert f"global_step_4 belongs to another run (respo N={REUSE}" in out and "this run is respo N=1" in out
    assert f"data.train_batch_size: {2 * REUSE} -> 2" in out
    assert "TaskRunner" not in out
    assert len(_logged_steps(tmp_path / "log.jsonl")) == 4  # nothing ran


def _kill_after(tmp_path: Path, command: list[str], marker: Path, timeout: float = 600) -> dict:
    """Run ``command`` and SIGKILL its driver as soon as ``marker`` exists; then wait up to the reaper's bound for
    every process of the driver's tree (recorded with psutil right before the kill: Ray's GCS, raylet, agents and
    workers, verl's TaskRunner among them) and every process naming the run's Ray temp dir to be gone.

    Returns what the driver had logged at the kill, the processes recorded, those left after the bound, and the
    output (the reaper writes its line there after the kill)."""
    import psutil

    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "log.jsonl"
    ray_tmp = tempfile.mkdtemp(prefix="rv-ray-", dir="/tmp")
    out_path = tmp_path / f"out-{time.monotonic_ns()}.txt"

    def naming_ray_tmp() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            try:
                if any(ray_tmp in arg for arg in proc.cmdline()):
                    found.append(proc)
            except psutil.Error:
                pass
        return found

    def running(procs: list[psutil.Process]) -> list[psutil.Process]:
        # is_running() compares the creation time too: a reused pid is not taken for the recorded process
        return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    try:
        with out_path.open("w") as out:
            proc = _start(tmp_path, command, ray_tmp, log, out)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and not marker.is_file() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert proc.poll() is None and marker.is_file(), out_path.read_text(errors="replace")[-4000:]
            logged = _logged_steps(log)
            driver = psutil.Process(proc.pid)
            tree = {p.pid: p for p in [*driver.children(recursive=True), *naming_ray_tmp()] if p.pid != proc.pid}
            described = {pid: " ".join(p.cmdline())[:120] for pid, p in tree.items()}
            proc.kill()
            proc.wait()
            killed = time.monotonic()
            while running(list(tree.values())) and time.monotonic() < killed + REAP_BOUND_S:
                time.sleep(0.2)
            left = {p.pid: described[p.pid] for p in running(list(tree.values()))}
            left.update({p.pid: " ".join(p.cmdline())[:120] for p in running(naming_ray_tmp())})
            gone_after = time.monotonic() - killed
            time.sleep(1)  # the reaper's line, written as it ends
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return {
        "logged": logged,
        "recorded": described,
        "left": left,
        "gone_after": gone_after,
        "out": out_path.read_text(errors="replace"),
    }


def test_sigkill_after_a_periodic_checkpoint_ray_is_gone_and_the_relaunch_resumes_exactly(uninterrupted, tmp_path):
    """The driver killed with SIGKILL once global_step_2 is complete (save_freq 1): no process of its Ray session is
    left after the reaper's bound, the relaunch resumes from the newest complete checkpoint, the log holds steps 1-4
    once each (a step the killed attempt logged after its checkpoint is logged again and counted once), and every
    metric and the final weights equal the uninterrupted run's (which saved every third step: saving changes
    nothing)."""
    folder = tmp_path / "ckpt"
    command = _command(folder, REUSE, 4, "trainer.save_freq=1", DETERMINISTIC)
    killed = _kill_after(tmp_path, command, folder / "global_step_2" / MARKER)
    names = " | ".join(killed["recorded"].values())
    assert "raylet" in names and "gcs_server" in names and "ray::TaskRunner" in names, names
    assert not killed["left"], (f"left {killed['gone_after']:.1f} s after SIGKILL", killed["left"])
    assert "respo-verl reaper: driver" in killed["out"], killed["out"][-3000:]
    # The marker is written after the step's line: a complete checkpoint's step is in the log.
    assert killed["logged"][:2] == [1, 2], killed["logged"]
    first_attempt = _logged_steps(tmp_path / "log.jsonl")
    assert first_attempt == list(range(1, len(first_attempt) + 1)) and len(first_attempt) in (2, 3), first_attempt

    resumed_from = max(int(p.parent.name.split("_")[-1]) for p in folder.glob(f"global_step_*/{MARKER}"))
    rc, out = _launch(tmp_path, command)
    assert rc == 0, out[-4000:]
    assert f"global_step_{resumed_from}" in out and "Resuming from" in out, out[-4000:]
    log = read_log(tmp_path / "log.jsonl")
    assert log.attempts == 2 and log.complete_through(4) and log.steps == [1, 2, 3, 4], (log.steps, log.continuity)
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    steps_then_events = [line.get("step", line.get("event")) for line in lines]
    assert steps_then_events == [*first_attempt, "resume", *range(resumed_from + 1, 5)], steps_then_events
    assert (folder / "global_step_4" / MARKER).is_file()
    _assert_resumed_exactly(tmp_path, uninterrupted, resumed_from)


def torch_equal(a, b) -> bool:
    import torch

    if hasattr(a, "full_tensor"):  # a DTensor shard of FSDP2
        a, b = a.full_tensor(), b.full_tensor()
    return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)


def test_a_collapsed_policy_stops_the_run(kit, tmp_path):
    """At lr 1.0 the first update collapses the policy: log W of a quarter to three quarters of the sequences at its
    clamp (measured: 0.5 and 0.75 at step 1 in two runs; a healthy run shows 0)."""
    command = _command(tmp_path / "ckpt", 2, 6, "actor_rollout_ref.actor.optim.lr=1.0", "trainer.save_freq=-1")
    rc, out = _launch(tmp_path, command)
    assert rc != 0, out[-4000:]
    tripped = re.search(r"RunStopped: step 1: (actor/respo/clamp_frac)=([0-9.]+) > run_guard\.max_clamp_share=", out)
    assert tripped, out[-4000:]
    # The step the guard stopped in is in the file log, with the metric that tripped it, marked as the stop.
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1], lines
    data = lines[0]["data"]
    assert data[STOPPED_KEY] == 1.0 and f"{data[tripped[1]]:.3f}" == tripped[2] and data[tripped[1]] > 0.1, data
    assert read_log(tmp_path / "log.jsonl").stopped_at == 1


def test_a_reward_function_that_raises_stops_a_cpu_run_at_the_first_failure(kit, tmp_path):
    """The reward function raises for one response of step 1 (tests/support/cpu_modules/raising_reward.py): verl
    evicts that prompt group and generates it again (training/rollout_failure/evicted_samples), the step's batch is
    full, and only verl's count says that a reward failed. The CPU preset's guard (max_failed_share 0) stops the run
    in step 1, and the step's line, with the failure counted, is in the file log."""
    reward = Path(__file__).resolve().parents[1] / "support" / "cpu_modules" / "raising_reward.py"
    command = _command(tmp_path / "ckpt", 2, 2, "trainer.save_freq=-1", f"reward.custom_reward_function.path={reward}")
    rc, out = _launch(tmp_path, command)
    assert rc != 0, out[-4000:]
    assert "raising_reward: the test's reward function fails for this response" in out, out[-4000:]
    assert "RunStopped: step 1: respo_verl/failed_share=" in out and "max_failed_share=0.0" in out, out[-4000:]
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
    command = _command(
        tmp_path / "ckpt",
        2,
        2,
        "trainer.save_freq=-1",
        f"ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='{modules}'",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH={MODULES}",
    )
    rc, out = _launch(tmp_path, command, timeout=420)
    assert rc != 0, out[-4000:]
    stopped = "RunStopped: step 1: agent-loop worker 0 of 1 has died while the step waited for its samples"
    assert stopped in out, out[-4000:]
    assert "ActorDiedError" in out and _logged_steps(tmp_path / "log.jsonl") == []
