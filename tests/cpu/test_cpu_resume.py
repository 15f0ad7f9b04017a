"""A run that survives pre-emption, end to end on CPU: ``python -m respo_verl.main_ppo algorithm=respo +device=cpu``.

Real subprocesses of our entry point with verl's V1 trainer (the respo-verl trainer registered in it), Ray, FSDP2 on
gloo and the hf_cpu rollout server; nothing is mocked. Against one uninterrupted run of the command (shared by the
module, and itself the check that ReSPO trains with rollout reuse through our entry point), one run of the same
command taken through both pre-emptions a cluster deals out, shared by the two tests that read it: a pre-emption
notice (SIGTERM to the driver), then a relaunch whose driver is killed with SIGKILL after the periodic checkpoint of
step 3 (its Ray processes must be gone within the reaper's bound); then its newest checkpoint is damaged (its
largest file cut to half), a relaunch is refused before Ray naming the file and an override, and the relaunch with
that override ends the run; and a relaunch of another configuration into the same folder, refused. The runs that a
fault stops are in test_cpu_stops.py.

The runs use verl's ``rollout.full_determinism``: the CPU rollout server then samples each request from (seed, step,
request id), the trainer orders each step's samples by the data loader, and two fresh runs log the same metrics: the
resumed run can be compared with the uninterrupted one step by step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from support import cpu_runs, procs
from support.trainer_checks import RESPO_KEYS, STALE_LOG_W, assert_trains, assert_weights_synced, log_w

from respo_verl.checkpoint import MARKER, TRACKER
from respo_verl.cpu.kit.build import KitSpec, build_kit, kit_root
from respo_verl.run.reaper import REAP_BOUND_S
from respo_verl.tools.runs.logs import read_log

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kit():
    return build_kit(KitSpec(), progress=False)


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
REAPER = "-m respo_verl.run.reaper"  # in the reaper's command line (respo_verl.run.reaper.watch_driver)


# Rollout reuse N of the uninterrupted run and of the runs resumed against it.
REUSE = 4


@pytest.fixture(scope="module")
def uninterrupted(kit, tmp_path_factory) -> Path:
    """The folder of one uninterrupted 4-step run (its log.jsonl and ckpt/): ReSPO at N = 4 through our entry point,
    the reference of the resumed runs. A run that fails fails every test that reads it, with its own output."""
    reference = tmp_path_factory.mktemp("uninterrupted")
    rc, out = cpu_runs.launch(
        reference, cpu_runs.command(reference / "ckpt", REUSE, 4, "trainer.save_freq=3", DETERMINISTIC)
    )
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


def _kill_after(tmp_path: Path, command: list[str], marker: Path, timeout: float = 600) -> dict:
    """Run ``command`` and SIGKILL its driver as soon as ``marker`` exists; then wait up to the reaper's bound for
    every process of the driver's tree (recorded with psutil right before the kill: Ray's GCS, raylet, agents and
    workers, verl's TaskRunner among them) and every process naming the run's Ray temp dir to be gone, and up to
    twice the bound for the reaper itself.

    Returns what the driver had logged at the kill, the processes recorded, those left after the bound, and the
    output (the reaper writes its line there after the kill)."""
    import psutil

    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "log.jsonl"
    ray_tmp = tempfile.mkdtemp(prefix="rv-ray-", dir="/tmp")
    out_path = tmp_path / f"out-{time.monotonic_ns()}.txt"

    try:
        with out_path.open("w") as out:
            proc = cpu_runs.start(tmp_path, command, ray_tmp, log, out)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and not marker.is_file() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert proc.poll() is None and marker.is_file(), out_path.read_text(errors="replace")[-4000:]
            logged = cpu_runs.logged_steps(log)
            driver = psutil.Process(proc.pid)
            tree = {p.pid: p for p in [*driver.children(recursive=True), *procs.naming(ray_tmp)] if p.pid != proc.pid}
            described = {pid: " ".join(p.cmdline())[:120] for pid, p in tree.items()}
            # The reaper is the driver's child and names the session, but is no process of it: it ends once it has
            # stopped them, after the bound's last wait (a loaded machine adds its scans of the process table).
            reapers = [p for pid, p in tree.items() if REAPER in described[pid]]
            tree = {pid: p for pid, p in tree.items() if p not in reapers}
            proc.kill()
            proc.wait()
            killed = time.monotonic()
            left = {p.pid: described[p.pid] for p in procs.wait_gone(tree.values(), REAP_BOUND_S)}
            left.update(
                {
                    p.pid: " ".join(p.cmdline())[:120]
                    for p in procs.naming(ray_tmp)
                    if procs.running(p) and p not in reapers
                }
            )
            gone_after = time.monotonic() - killed
            reaper_left = procs.wait_gone(reapers, 2 * REAP_BOUND_S - (time.monotonic() - killed))
            time.sleep(1)  # the reaper's line, written as it ends
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return {
        "logged": logged,
        "recorded": described,
        "left": left,
        "gone_after": gone_after,
        "reapers": len(reapers),
        "reaper_left": [p.pid for p in reaper_left],
        "out": out_path.read_text(errors="replace"),
    }


@pytest.fixture(scope="module")
def preempted(uninterrupted, tmp_path_factory) -> dict:
    """One run of the reference's command (save_freq 3) taken through both pre-emptions, as a cluster would:

    1. SIGTERM to the driver once step 1 is logged: the trainer saves at the end of its step and ends (exit 0);
    2. the relaunch resumes from that checkpoint, and its driver is killed with SIGKILL as soon as the periodic
       checkpoint of step 3 is complete;
    3. the largest file of the newest complete checkpoint is cut to half (a copy or a disk that failed): a relaunch
       is refused before Ray (in this process: no driver of its own), naming the checkpoint, the file and the
       override that resumes from the newest intact checkpoint before it;
    4. the relaunch with that override resumes from there and ends the run.

    Each attempt's outcome is kept for the tests below; an attempt that fails fails them all with its own output."""
    run = tmp_path_factory.mktemp("preempted")
    folder = run / "ckpt"
    command = cpu_runs.command(folder, REUSE, 4, "trainer.save_freq=3", DETERMINISTIC)
    result: dict = {"run": run, "folder": folder, "command": command}

    rc, out = cpu_runs.launch(run, command, sigterm_after_step=1)
    if rc != 0:
        pytest.fail(f"attempt 1 (SIGTERM after step 1) ended with {rc}:\n{out[-4000:]}", pytrace=False)
    result["sigterm"] = {
        "out": out,
        "steps": cpu_runs.logged_steps(run / "log.jsonl"),
        "complete": sorted(p.parent.name for p in folder.glob(f"global_step_*/{MARKER}")),
        "tracker": (folder / TRACKER).read_text().strip() if (folder / TRACKER).is_file() else None,
    }
    killed = _kill_after(run, command, folder / "global_step_3" / MARKER)
    if "Resuming from" not in killed["out"]:
        pytest.fail(f"attempt 2 (relaunch, SIGKILL after step 3's checkpoint):\n{killed['out'][-4000:]}", pytrace=False)
    result["sigkill"] = killed
    result["before_last"] = cpu_runs.logged_steps(run / "log.jsonl")
    newest = max(int(p.parent.name.split("_")[-1]) for p in folder.glob(f"global_step_*/{MARKER}"))
    result["newest"] = newest
    files = [p for p in (folder / f"global_step_{newest}").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    size = largest.stat().st_size
    with largest.open("r+b") as fh:
        fh.truncate(size // 2)
    refused = _refused_in_process(run, command)
    said = refused.stdout + refused.stderr
    result["damaged"] = {"file": largest, "size": size, "rc": refused.returncode, "out": said}
    override = re.search(r"add (trainer\.resume_mode=resume_path trainer\.resume_from_path=(\S+))$", said, re.M)
    if refused.returncode != 2 or override is None:
        pytest.fail(f"the damaged checkpoint was not refused with an override:\n{said[-4000:]}", pytrace=False)
    result["override"] = override[1].split()
    result["resumed_from"] = int(Path(override[2]).name.split("_")[-1])
    rc, out = cpu_runs.launch(run, [*command, *result["override"]])
    if rc != 0:
        pytest.fail(f"attempt 3 (relaunch with the override) ended with {rc}:\n{out[-4000:]}", pytrace=False)
    result["last"] = out
    return result


def test_sigterm_saves_and_stops_the_relaunch_resumes_exactly_another_run_is_refused(preempted, uninterrupted):
    folder, sigterm = preempted["folder"], preempted["sigterm"]
    # save_freq 3: the checkpoint at step 1 or 2 exists only because the pre-emption notice asked for it
    out = sigterm["out"]
    assert "SIGTERM: the trainer saves at the end of this step" in out
    stopped = max(sigterm["steps"])
    assert stopped in (1, 2), out[-4000:]  # the step the notice arrived in, or the next one
    assert sigterm["steps"] == list(range(1, stopped + 1)), sigterm["steps"]
    assert f"stop requested (SIGTERM to the driver): saved global_step_{stopped}, ending the run" in out
    assert sigterm["complete"] == [f"global_step_{stopped}"] and sigterm["tracker"] == str(stopped)

    # the relaunch resumed from that checkpoint (then was killed: test_sigkill_... below)
    relaunch = preempted["sigkill"]["out"]
    assert f"global_step_{stopped}" in relaunch and "Resuming from" in relaunch, relaunch[-4000:]
    run = preempted["run"]
    log = read_log(run / "log.jsonl")
    assert log.attempts == 3 and log.complete_through(4), (log.steps, log.continuity)
    lines = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    second = [s for s in preempted["before_last"] if s > stopped]
    # the override resumed from before the damaged checkpoint: the steps attempt 2 logged after it are logged again
    again = [s for s in second if s > preempted["resumed_from"]]
    assert log.steps == [1, 2, 3, 4] and len(log.continuity) == (1 if again else 0), log.continuity
    if again:
        note = log.continuity[0]
        assert note.startswith(f"steps {again[0]}") and "logged by more than one attempt (attempts [2, 3])" in note
    events = [line.get("step", line.get("event")) for line in lines]
    resumed_from = preempted["resumed_from"]
    assert events == [*range(1, stopped + 1), "resume", *second, "resume", *range(resumed_from + 1, 5)], events
    assert (folder / "global_step_4" / MARKER).is_file()

    # every step's metrics and the final weights are the uninterrupted run's, through both resumptions
    _assert_resumed_exactly(run, uninterrupted, stopped)

    # Another configuration (N = 1) launched into the same folder: refused before Ray starts, naming both. The
    # refusal needs no process of its own: the entry point runs in this one (Ray is not started when it refuses).
    logged = (run / "log.jsonl").read_text()
    refused = _refused_in_process(run, cpu_runs.command(folder, 1, 4, "trainer.save_freq=3"))
    out = refused.stdout + refused.stderr
    assert refused.returncode == 2, out[-4000:]
    assert f"global_step_4 belongs to another run (respo N={REUSE}" in out and "this run is respo N=1" in out
    assert f"data.train_batch_size: {2 * REUSE} -> 2" in out
    assert "TaskRunner" not in out
    assert (run / "log.jsonl").read_text() == logged  # nothing ran


def test_sigkill_after_a_periodic_checkpoint_ray_is_gone_and_the_relaunch_resumes_exactly(preempted, uninterrupted):
    """The driver of the pre-empted run's second attempt killed with SIGKILL once global_step_3 (save_freq 3) is
    complete: no process of its Ray session is left after the reaper's bound, the relaunch takes the newest complete
    checkpoint (verifies it: the refusal of its damaged file below names it), the log holds steps 1-4 once each (a
    step the killed attempt logged after its checkpoint is logged again and counted once), and every metric and the
    final weights equal the uninterrupted run's."""
    killed, folder = preempted["sigkill"], preempted["folder"]
    names = " | ".join(killed["recorded"].values())
    assert "raylet" in names and "gcs_server" in names and "ray::TaskRunner" in names, names
    assert not killed["left"], (f"left {killed['gone_after']:.1f} s after SIGKILL", killed["left"])
    assert killed["reapers"] == 1 and not killed["reaper_left"], killed
    assert "respo-verl reaper: driver" in killed["out"], killed["out"][-3000:]
    # The marker is written after the step's line: a complete checkpoint's step is in the log.
    assert killed["logged"][:3] == [1, 2, 3], killed["logged"]
    before = preempted["before_last"]
    assert before[-1] in (3, 4) and sorted(set(before)) == list(range(1, before[-1] + 1)), before

    newest, resumed_from = preempted["newest"], preempted["resumed_from"]
    assert newest in (3, 4), newest
    out = preempted["last"]
    assert f"global_step_{resumed_from}" in out and "Resuming from" in out, out[-4000:]
    log = read_log(preempted["run"] / "log.jsonl")
    assert log.attempts == 3 and log.complete_through(4) and log.steps == [1, 2, 3, 4], (log.steps, log.continuity)
    assert (folder / "global_step_4" / MARKER).is_file()
    _assert_resumed_exactly(preempted["run"], uninterrupted, min(preempted["sigterm"]["steps"][-1], resumed_from))


def torch_equal(a, b) -> bool:
    import torch

    if hasattr(a, "full_tensor"):  # a DTensor shard of FSDP2
        a, b = a.full_tensor(), b.full_tensor()
    return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)


def test_a_damaged_checkpoint_is_refused_before_ray_and_the_override_it_prints_resumes(preempted, uninterrupted):
    """The newest complete checkpoint with its largest file cut to half: the relaunch stops in seconds, before Ray,
    with exit 2 and one line naming the checkpoint, the file and the override; with that override the run resumes
    from the newest intact checkpoint before it and ends with every metric and the final weights of the
    uninterrupted run (verl alone had started Ray, built the workers and failed after 64 s on the zip archive)."""
    damaged, folder, newest = preempted["damaged"], preempted["folder"], preempted["newest"]
    out = damaged["out"]
    assert damaged["rc"] == 2, out[-4000:]
    line = [line for line in out.splitlines() if "DAMAGED CHECKPOINT" in line]
    assert len(line) == 1, out[-4000:]
    checkpoint, before = folder / f"global_step_{newest}", preempted["resumed_from"]
    half, whole = damaged["size"] // 2, damaged["size"]
    assert f"DAMAGED CHECKPOINT {checkpoint}: {damaged['file']} has {half} bytes, the save wrote {whole}" in line[0]
    assert line[0].endswith(
        f"to resume from global_step_{before}, the newest intact checkpoint before it, add "
        f"trainer.resume_mode=resume_path trainer.resume_from_path={folder / f'global_step_{before}'}"
    ), line[0]
    assert before < newest and "TaskRunner" not in out and "ray init" not in out
    last = preempted["last"]
    assert f"global_step_{before}" in last and "Resuming from" in last, last[-4000:]
    _assert_resumed_exactly(preempted["run"], uninterrupted, min(preempted["sigterm"]["steps"][-1], before))
