"""``respo-verl sweep --out DIR`` on this machine, end to end, on a stand-in run program.

Why a stand-in: what the sweep itself does (its folder lock, a run that fails or is killed, a killed or interrupted
sweep, resuming and skipping, ``--force``, progress and reports) does not depend on what a run computes, and a verl run
costs about 70 CPU seconds where the stand-in (tests/support/standin/standin_run.py) takes a second. The stand-in is a
real program that the real sweep starts (tests/support/standin_sweep.py changes only the run's module): it writes verl's
log lines, saves checkpoint folders, resumes from its tracker and honours SIGTERM as the respo-verl trainer does. That
the trainer itself does those things is tested on verl runs in tests/cpu/test_cpu_resume.py. The suite's one real sweep
of verl runs (two runs, ReSPO and VESPO) is the demo's, in tests/cpu/test_demo.py: ``respo-verl demo`` runs its two runs
through ``respo-verl sweep``, and that test checks that the sweep's runs are verl runs that train, write their output to
their own files, are recorded in the manifest with a configuration hash, and are read by ``respo-verl report``.

The stand-in grid is ReSPO, VESPO and GRPO at N = 2 (4 steps each, a checkpoint after every step), driven through three
invocations of the same command (and one refused), shared by the module's tests:

1. the sweep is killed with SIGKILL once ReSPO's checkpoint of step 1 is complete; its run gets SIGTERM from the
   kernel, saves at the end of its step and ends by itself;
2. the same command again (started at once, while that run may still be saving): it waits for the run's lock, then
   ReSPO resumes from its own last checkpoint; a second sweep started in the folder meanwhile is refused; the report
   is read over the folder with one run partial; VESPO's run is killed with SIGKILL as soon as it starts, GRPO's
   fails with exit status 3 in its step 2; the sweep reports both and ends with exit status 1;
3. the same command once more: ReSPO is skipped, VESPO runs from step 1, GRPO resumes from its step 1 and ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.standin_sweep import STANDIN_SWEEP

from respo_verl.checkpoint import MARKER
from respo_verl.tools.runs.logs import read_log
from respo_verl.tools.runs.manifest import read_manifest

pytestmark = pytest.mark.slow

RESPO, VESPO, GRPO = "cpu-respo-n2-s0", "cpu-vespo-n2-s0", "cpu-grpo-n2-s0"
STEPS = 4
TIMEOUT_S = 300


def _grid(out: Path, algos: str = "respo,vespo,grpo", steps: int = STEPS) -> list[str]:
    return [
        "--out", str(out), "--model", "cpu", "--algos", algos, "--reuse", "2", "--seeds", "0", "--mini-batch", "2",
        "--optimizer-steps", str(2 * steps), "--no-compose",
    ]  # fmt: skip


def _standin(out: Path, *extra: str, step_s: float = 0.5) -> list[str]:
    """The stand-in sweep's command: the grid, then the runs' overrides."""
    return [
        sys.executable,
        STANDIN_SWEEP,
        *_grid(out),
        *extra,
        "--",
        "trainer.save_freq=1",
        f"+standin.step_s={step_s}",
    ]


def _env(**knobs: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT")}
    env.update(knobs)
    return env


def _child(sweep, name: str):
    """The run ``name``'s process among the sweep's children, or None."""
    import psutil

    try:
        children = psutil.Process(sweep.pid).children()
    except psutil.Error:
        return None
    for child in children:
        try:
            if f"trainer.experiment_name={name}" in child.cmdline():
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
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {TIMEOUT_S} s (sweep status {sweep.poll()}):\n{output.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep_standin")
    out = root / "out"
    argv = _standin(out)
    result: dict = {"out": out}

    # 1. killed once ReSPO's checkpoint of step 1 is complete; the run's save after SIGTERM takes a few seconds
    first = root / "sweep1.txt"
    with first.open("w") as fh:
        sweep = subprocess.Popen(argv, cwd=root, env=_env(STANDIN_SAVE_S="8"), stdout=fh, stderr=subprocess.STDOUT)
        marker = out / "checkpoints" / RESPO / "global_step_1" / MARKER
        _wait(marker.is_file, "ReSPO's checkpoint of step 1", sweep, first)
        orphan = _child(sweep, RESPO)
        assert orphan is not None, first.read_text()[-3000:]
        sweep.kill()
        sweep.wait()
    result["first"] = first.read_text()

    # 2. the same command at once, GRPO failing in its step 2, ReSPO slow enough for the report to find it partial and
    # VESPO to be killed before it logs a step (environment knobs of the stand-in: the command stays the same)
    second = root / "sweep2.txt"
    with second.open("w") as fh:
        sweep = subprocess.Popen(
            argv,
            cwd=root,
            env=_env(STANDIN_FAIL=f"{GRPO}@2", STANDIN_SLOW=f"{RESPO}@10/{VESPO}@60"),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        _wait(lambda: _child(sweep, RESPO), "ReSPO's run, again", sweep, second)
        result["orphan_output"] = (out / "logs" / f"{RESPO}.out").read_text()
        result["killed_at_steps"] = read_log(out / "logs" / f"{RESPO}.jsonl").steps
        # the report over the folder while ReSPO is partial and the others have not started
        report = subprocess.run(
            [sys.executable, "-m", "respo_verl.cli", "report", str(out), "--out", str(root / "report1"), "--no-plots"],
            capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S,
        )  # fmt: skip
        result["partial_report"] = (report.returncode, report.stderr, root / "report1" / "report.md")
        # a second sweep in the folder while this one runs
        busy = subprocess.run(argv, cwd=root, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
        result["busy"] = (busy.returncode, busy.stdout, busy.stderr, sweep.pid)
        victim = _wait(lambda: _child(sweep, VESPO), "VESPO's run", sweep, second)
        victim.kill()
        result["second_status"] = sweep.wait(timeout=TIMEOUT_S)
    result["second"] = second.read_text()

    # 3. once more: ReSPO skipped, VESPO from step 1, GRPO from its checkpoint of step 1
    third = subprocess.run(argv, cwd=root, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    result["third_status"], result["third"] = third.returncode, third.stdout + third.stderr
    return result


def test_each_run_has_its_own_checkpoint_folder_in_the_manifest(standin):
    out = standin["out"]
    folders = {}
    for record in read_manifest(out / "manifest.jsonl"):
        (value,) = [a.split("=", 1)[1] for a in record.command if a.startswith("trainer.default_local_dir=")]
        folders[record.name] = value
        assert record.command[:3] == ["python", "-m", "standin_run"], record.command
    assert folders == {name: str((out / "checkpoints" / name).resolve()) for name in (RESPO, VESPO, GRPO)}


def test_a_killed_sweep_leaves_its_run_to_save_and_end(standin):
    """SIGKILL of the sweep: the run got SIGTERM, saved at the end of its step and ended with exit 0."""
    text = standin["orphan_output"]
    stopped = standin["killed_at_steps"]
    assert "standin: SIGTERM: saved global_step_" in text and "ending the run" in text, text[-3000:]
    assert stopped[:1] == [1] and max(stopped) < STEPS, stopped
    # The restarted sweep started ReSPO again only after that run had ended (it holds the folder's lock): the sweep
    # said it waited, and in the run's output file the new attempt's header follows the old run's last line.
    assert f"waiting for run {RESPO} (pid " in standin["second"], standin["second"][-3000:]
    output = (standin["out"] / "logs" / f"{RESPO}.out").read_text()
    assert output.index("ending the run") < output.rindex("=== respo-verl sweep"), output[-3000:]


def test_a_second_sweep_in_a_folder_a_live_sweep_holds_is_refused(standin):
    status, stdout, stderr, pid = standin["busy"]
    assert status == 2 and stdout == "", (stdout, stderr)
    assert stderr.strip() == (
        f"respo-verl sweep: another sweep (pid {pid}) is running in {standin['out']}; wait for it or stop it"
    )


def test_the_interrupted_run_resumes_from_its_own_checkpoint_and_logs_every_step_once(standin):
    out = standin["out"]
    text = (out / "logs" / f"{RESPO}.out").read_text()
    last_attempt = text[text.rindex("=== respo-verl sweep") :]
    folder = out / "checkpoints" / RESPO
    assert f"standin: Resuming from {folder / 'global_step_'}" in last_attempt, last_attempt[-3000:]
    log = read_log(out / "logs" / f"{RESPO}.jsonl")
    assert log.steps == [1, 2, 3, 4] and log.attempts == 2, (log.steps, log.continuity)
    assert log.complete_through(STEPS)
    assert (folder / f"global_step_{STEPS}" / MARKER).is_file()
    assert f"run 1 of 3: {RESPO} ran: {STEPS} steps logged" in standin["second"]


def test_a_run_whose_process_dies_is_reported_and_the_sweep_goes_on(standin):
    text = standin["second"]
    assert standin["second_status"] == 1, text[-3000:]
    assert f"run {VESPO} failed: killed by signal SIGKILL, 0 of {STEPS} steps logged" in text, text[-3000:]
    assert f"full output: {standin['out'] / 'logs' / f'{VESPO}.out'}" in text
    assert text.rstrip().splitlines()[-1] == f"1 done, 2 failed: {VESPO}, {GRPO}"


def test_a_run_that_fails_is_reported_with_the_last_lines_of_its_output(standin):
    text = standin["second"]
    report = text[text.index(f"run {GRPO} failed: exit status 3, 1 of {STEPS} steps logged") :].splitlines()
    assert report[1] == "  the last lines of its output:", report[:6]
    assert f"  | standin: {GRPO} fails in step 2 (+standin.fail)" in report, report[:12]
    assert f"  full output: {standin['out'] / 'logs' / f'{GRPO}.out'}" in report


def test_the_same_command_skips_complete_runs_and_finishes_the_others(standin):
    text = standin["third"]
    assert standin["third_status"] == 0, text[-3000:]
    assert f"run 1 of 3: {RESPO} skipped, its log is complete" in text
    assert text.rstrip().splitlines()[-1] == "3 done"
    vespo = read_log(standin["out"] / "logs" / f"{VESPO}.jsonl")
    assert vespo.steps == [1, 2, 3, 4] and vespo.continuity == [] and vespo.attempts == 1
    grpo = read_log(standin["out"] / "logs" / f"{GRPO}.jsonl")
    assert grpo.steps == [1, 2, 3, 4] and grpo.attempts == 2, (grpo.steps, grpo.continuity)


def test_progress_is_one_line_per_refresh_off_a_terminal(standin):
    """Run i of n, step s of S, the sweep's steps, elapsed and remaining time; the runs' own output is not there."""
    lines = standin["third"].splitlines()
    progress = [line for line in lines if line.startswith(f"run 2 of 3: {VESPO}, step ")]
    assert progress, standin["third"][-3000:]
    assert progress[-1].startswith(f"run 2 of 3: {VESPO}, step 4 of 4 | ")
    last = [line for line in lines if line.startswith(f"run 3 of 3: {GRPO}, step ")][-1]
    assert last.startswith(f"run 3 of 3: {GRPO}, step 4 of 4 | 12 of 12 steps of the sweep | "), lines[-6:]
    assert "elapsed, ~" in progress[-1] and progress[-1].endswith(" left")
    assert all("\r" not in line for line in lines)
    assert "standin:" not in standin["third"]


def test_a_report_over_a_folder_with_a_partial_run_says_so(standin):
    status, err, report = standin["partial_report"]
    assert status == 0, err
    text = report.read_text()
    found = re.search(rf"{RESPO}: incomplete: (\d+) of {STEPS} training steps logged", text)
    assert found and len(standin["killed_at_steps"]) <= int(found[1]) < STEPS, text
    assert f"{VESPO}: in the manifest but no log" in text, text


def test_outputs_go_to_files_beside_the_logs(standin):
    logs = standin["out"] / "logs"
    for name in (RESPO, VESPO, GRPO):
        text = (logs / f"{name}.out").read_text()
        assert text.count("=== respo-verl sweep") >= 2, text[:2000]
    assert json.loads((logs / f"{VESPO}.jsonl").read_text().splitlines()[0])["step"] == 1


def test_sigterm_to_the_sweep_stops_its_run_which_saves_and_the_same_command_resumes(tmp_path):
    """Ctrl-C or SIGTERM of the sweep: the running run gets SIGTERM, saves at the end of its step and ends, and the
    sweep ends without starting another run (exit 130); the same command resumes the run from that checkpoint."""
    out = tmp_path / "out"
    argv = _standin(out)
    output = tmp_path / "sweep.txt"
    with output.open("w") as fh:
        sweep = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=fh, stderr=subprocess.STDOUT)
        log = out / "logs" / f"{RESPO}.jsonl"
        _wait(lambda: log.is_file() and log.read_text().strip(), "ReSPO's first step", sweep, output)
        sweep.send_signal(signal.SIGTERM)
        status = sweep.wait(timeout=TIMEOUT_S)
    text = output.read_text()
    assert status == 130, text[-3000:]
    assert f"SIGTERM: stopping {RESPO}, which saves at the end of its current step" in text, text[-3000:]
    stopped = read_log(log).steps
    assert stopped[0] == 1 and max(stopped) < STEPS, stopped
    assert text.rstrip().splitlines()[-1] == f"0 done, interrupted: {RESPO}, 2 not started", text[-3000:]
    assert (out / "checkpoints" / RESPO / f"global_step_{max(stopped)}" / MARKER).is_file()
    assert not (out / "logs" / f"{VESPO}.out").exists()
    again = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert again.returncode == 0 and again.stdout.rstrip().splitlines()[-1] == "3 done", again.stdout[-3000:]
    log = read_log(out / "logs" / f"{RESPO}.jsonl")
    assert log.steps == [1, 2, 3, 4] and log.attempts == 2, (log.steps, log.continuity)


def test_force_replaces_a_grid_with_other_settings_and_its_runs_start_afresh(tmp_path):
    """A complete one-run sweep, then the same grid with another setting: refused in one line without ``--force``;
    with it, the run's log, output and checkpoint folder move to ``replaced-<time>/`` and the run starts from step 1."""
    out = tmp_path / "out"
    argv = [sys.executable, STANDIN_SWEEP, *_grid(out, "respo", 2), "--", "trainer.save_freq=1", "+standin.step_s=0.2"]
    first = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    changed = [*argv[:-1], "+standin.step_s=0.3"]
    refused = subprocess.run(changed, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert "here: +standin.step_s=0.3); use --force to replace it" in refused.stderr, refused.stderr
    forced = [*changed[: changed.index("--")], "--force", *changed[changed.index("--") :]]
    again = subprocess.run(forced, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    (moved,) = out.glob("replaced-*")
    assert f"--force: the files of the runs that differ moved to {moved}" in again.stderr
    assert sorted(p.name for p in (moved / RESPO).iterdir()) == [RESPO, f"{RESPO}.jsonl", f"{RESPO}.out"]
    assert (moved / RESPO / RESPO / "global_step_2" / MARKER).is_file()
    log = read_log(out / "logs" / f"{RESPO}.jsonl")
    assert log.steps == [1, 2] and log.attempts == 1, (log.steps, log.continuity)
    assert "Resuming from" not in (out / "logs" / f"{RESPO}.out").read_text()
