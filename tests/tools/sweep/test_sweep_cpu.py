"""``respo-verl sweep --out DIR`` over verl's own trainer on this CPU, end to end, nothing mocked.

One grid of two runs, ReSPO and VESPO at N = 2 (4 training steps each, a checkpoint after every step), driven through
three invocations of the same command, shared by the module's tests:

1. the sweep is killed with SIGKILL once ReSPO's checkpoint of step 1 is complete; its run gets SIGTERM from the
   kernel, saves at the end of its step and ends by itself;
2. the same command again (started at once, while that run may still be saving): ReSPO resumes from its own last
   checkpoint through verl's resume; VESPO's driver is killed with SIGKILL as soon as it starts, and the sweep
   reports it and ends with exit status 1 and ``1 done, 1 failed: <name>``;
3. the same command once more: ReSPO is skipped, VESPO runs from step 1 to the end.

Between 1 and 2 the report is read over the folder, with one run partial and one not started.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from respo_verl.cpu.kit.build import KitSpec, build_kit, kit_root
from respo_verl.run.checkpoint import MARKER
from respo_verl.tools.runs.logs import read_log
from respo_verl.tools.runs.manifest import read_manifest

pytestmark = pytest.mark.slow

RESPO, VESPO = "cpu-respo-n2-s0", "cpu-vespo-n2-s0"
STEPS = 4
TIMEOUT_S = 900


def _argv(out: Path, ray_tmp: str) -> list[str]:
    return [
        sys.executable, "-m", "respo_verl.cli", "sweep", "--out", str(out), "--model", "cpu",
        "--algos", "respo,vespo", "--reuse", "2", "--seeds", "0", "--mini-batch", "2", "--optimizer-steps", "8",
        "--", "+device=cpu", "trainer.save_freq=1", f"+ray_kwargs.ray_init._temp_dir={ray_tmp}",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT")}
    env.update(RESPO_VERL_CPU_KIT=str(kit_root()), HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    env["TORCH_COMPILE_DISABLE"] = "1"
    return env


def _driver(sweep, name: str):
    """The run ``name``'s driver among the sweep's children, or None."""
    import psutil

    try:
        children = psutil.Process(sweep.pid).children()
    except psutil.Error:
        return None
    for child in children:
        try:
            if any(f"trainer.experiment_name={name}" == arg for arg in child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def _wait(condition, what: str, sweep, output: Path):
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if sweep.poll() is not None:
            break
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {TIMEOUT_S} s (sweep status {sweep.poll()}):\n{output.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):

    build_kit(KitSpec(), progress=False)
    root = tmp_path_factory.mktemp("sweep_cpu")
    out = root / "out"
    ray_tmp = tempfile.mkdtemp(prefix="rv-ray-", dir="/tmp")  # Ray's socket paths must stay short
    argv = _argv(out, ray_tmp)
    result: dict = {"out": out}
    try:
        # 1. killed once ReSPO's checkpoint of step 1 is complete
        first = root / "sweep1.txt"
        with first.open("w") as fh:
            sweep = subprocess.Popen(argv, cwd=root, env=_env(), stdout=fh, stderr=subprocess.STDOUT)
            marker = out / "checkpoints" / RESPO / "global_step_1" / MARKER
            _wait(marker.is_file, "ReSPO's checkpoint of step 1", sweep, first)
            orphan = _driver(sweep, RESPO)
            assert orphan is not None, first.read_text()[-3000:]
            sweep.kill()
            sweep.wait()
        result["first"] = first.read_text()

        # 2. the same command at once: ReSPO resumes once its orphaned driver has saved; VESPO's driver is killed
        second = root / "sweep2.txt"
        with second.open("w") as fh:
            sweep = subprocess.Popen(argv, cwd=root, env=_env(), stdout=fh, stderr=subprocess.STDOUT)
            _wait(lambda: _driver(sweep, RESPO), "ReSPO's driver, again", sweep, second)
            result["orphan_output"] = (out / "logs" / f"{RESPO}.out").read_text()
            result["killed_at_steps"] = read_log(out / "logs" / f"{RESPO}.jsonl").steps  # the new driver starts up
            # the report over the folder while ReSPO is partial and VESPO has not started
            report = subprocess.run(
                [sys.executable, "-m", "respo_verl.cli", "report", str(out), "--out", str(root / "report1"),
                 "--no-plots"], capture_output=True, text=True, env=_env(), timeout=300,
            )  # fmt: skip
            result["partial_report"] = (report.returncode, report.stderr, root / "report1" / "report.md")
            victim = _wait(lambda: _driver(sweep, VESPO), "VESPO's driver", sweep, second)
            victim.kill()
            result["second_status"] = sweep.wait(timeout=TIMEOUT_S)
        result["second"] = second.read_text()

        # 3. once more: ReSPO skipped, VESPO from step 1
        third = subprocess.run(argv, cwd=root, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
        result["third_status"], result["third"] = third.returncode, third.stdout + third.stderr
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return result


def test_each_run_has_its_own_checkpoint_folder_in_the_manifest(sweep):
    out = sweep["out"]
    records = read_manifest(out / "manifest.jsonl")
    folders = {}
    for record in records:
        (value,) = [a.split("=", 1)[1] for a in record.command if a.startswith("trainer.default_local_dir=")]
        folders[record.name] = value
    assert folders == {name: str((out / "checkpoints" / name).resolve()) for name in (RESPO, VESPO)}


def test_a_killed_sweep_leaves_its_run_to_save_and_end(sweep):
    """SIGKILL of the sweep: the run's driver got SIGTERM, saved at the end of its step and ended with exit 0."""
    text = sweep["orphan_output"]
    stopped = sweep["killed_at_steps"]
    assert "SIGTERM: the trainer saves at the end of this step" in text, text[-3000:]
    assert "ending the run" in text, text[-3000:]
    assert stopped[:1] == [1] and max(stopped) < STEPS, stopped
    # The restarted sweep started ReSPO again only after that driver had ended (it holds the folder's lock): in the
    # run's output file the new attempt's header follows the old driver's last line.
    output = (sweep["out"] / "logs" / f"{RESPO}.out").read_text()
    assert output.index("ending the run") < output.rindex("=== respo-verl sweep"), output[-3000:]


def test_the_interrupted_run_resumes_from_its_own_checkpoint_and_logs_every_step_once(sweep):
    out = sweep["out"]
    text = (out / "logs" / f"{RESPO}.out").read_text()
    last_attempt = text[text.rindex("=== respo-verl sweep") :]
    folder = out / "checkpoints" / RESPO
    assert "Resuming from" in last_attempt and str(folder / "global_step_") in last_attempt, last_attempt[-3000:]
    log = read_log(out / "logs" / f"{RESPO}.jsonl")
    assert log.steps == [1, 2, 3, 4] and log.attempts == 2, (log.steps, log.continuity)
    assert log.complete_through(STEPS)
    assert (folder / f"global_step_{STEPS}" / MARKER).is_file()
    assert f"run 1 of 2: {RESPO} ran: {STEPS} steps logged" in sweep["second"]


def test_a_run_whose_driver_dies_is_reported_and_the_sweep_goes_on(sweep):
    text = sweep["second"]
    assert sweep["second_status"] == 1, text[-3000:]
    assert f"run {VESPO} failed: killed by signal SIGKILL, 0 of {STEPS} steps logged" in text, text[-3000:]
    assert f"full output: {sweep['out'] / 'logs' / f'{VESPO}.out'}" in text
    assert text.rstrip().splitlines()[-1] == f"1 done, 1 failed: {VESPO}"


def test_the_same_command_skips_complete_runs_and_finishes_the_others(sweep):
    text = sweep["third"]
    assert sweep["third_status"] == 0, text[-3000:]
    assert f"run 1 of 2: {RESPO} skipped, its log is complete" in text
    assert text.rstrip().splitlines()[-1] == "2 done"
    log = read_log(sweep["out"] / "logs" / f"{VESPO}.jsonl")
    assert log.steps == [1, 2, 3, 4] and log.continuity == []


def test_progress_is_one_line_per_refresh_off_a_terminal(sweep):
    """Run i of n, step s of S, the sweep's steps, elapsed and remaining time; the runs' own output is not there."""
    lines = sweep["third"].splitlines()
    progress = [line for line in lines if line.startswith(f"run 2 of 2: {VESPO}, step ")]
    assert progress, sweep["third"][-3000:]
    assert progress[-1].startswith(f"run 2 of 2: {VESPO}, step 4 of 4 | 8 of 8 steps of the sweep | ")
    assert "elapsed, ~" in progress[-1] and progress[-1].endswith(" left")
    assert all("\r" not in line for line in lines)
    assert "TaskRunner" not in sweep["third"] and "Resuming from" not in sweep["second"]


def test_a_report_over_a_folder_with_a_partial_run_says_so(sweep):
    status, err, report = sweep["partial_report"]
    assert status == 0, err
    text = report.read_text()
    logged = len(sweep["killed_at_steps"])
    assert f"{RESPO}: incomplete: {logged} of {STEPS} training steps logged" in text, text
    assert f"{VESPO}: in the manifest but no log" in text, text


def test_outputs_go_to_files_beside_the_logs(sweep):
    logs = sweep["out"] / "logs"
    for name in (RESPO, VESPO):
        text = (logs / f"{name}.out").read_text()
        assert text.count("=== respo-verl sweep") >= 2, text[:2000]
    assert json.loads((logs / f"{VESPO}.jsonl").read_text().splitlines()[0])["step"] == 1
