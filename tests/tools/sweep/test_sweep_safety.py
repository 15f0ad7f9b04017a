"""`respo-verl sweep` touches only its own files: a planted manifest, a held lock, a hostile ``--model``, a symlinked
lock, and the run's start (no pre-exec function, no interrupt lost between starting a run and recording it).

Nothing here trains: the files standing for a run's log, output and checkpoints are plain files, the processes are
``sleep``-like stand-ins.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import procs

from respo_verl.cli import main as cli_main
from respo_verl.tools.runs.manifest import MANIFEST_NAME, RunRecord, read_manifest, write_manifest
from respo_verl.tools.sweep.grid import SweepSpec, expand
from respo_verl.tools.sweep.local import LOCK_NAME, _Interrupts
from respo_verl.tools.sweep.runner import SweepConflict, replace_sweep

GRID = ["sweep", "--no-compose", "--algos", "respo", "--reuse", "8", "--seeds", "0"]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _planted(out: Path, victim: Path, how: str) -> None:
    """A manifest in ``out`` whose one run names ``victim`` (a file of the user's, outside ``out``) as its log or its
    checkpoint folder, as a manifest planted by someone else, or copied from another folder, could."""
    log = str(victim) if how == "log" else "logs/x.jsonl"
    command = ["python", "-m", "respo_verl.main_ppo"]
    if how == "checkpoints":
        command.append(f"trainer.default_local_dir={victim}")
    record = RunRecord("planted-respo-n8-s0", "respo", 8, 0, log, 1024, "h", command=command)
    write_manifest([record], out)


@pytest.mark.parametrize("how", ["log", "checkpoints"])
def test_force_moves_nothing_a_planted_manifest_names_outside_out(tmp_path, capsys, how):
    out, victim = tmp_path / "out", tmp_path / "precious"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work\n")
    if how == "log":
        victim = victim / "thesis.tex"
    _planted(out, victim, how)
    records = expand(SweepSpec(algorithms=("respo",), reuse=(8,), seeds=(0,), out_dir=out), compose=False)
    with pytest.raises(SweepConflict, match="outside"):
        replace_sweep(records, out)
    assert cli_main([*GRID, "--print", "--force", "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("respo-verl sweep: --out ") and str(victim) in line and "outside" in line
    assert (tmp_path / "precious" / "thesis.tex").read_text() == "years of work\n"
    assert not list(out.glob("replaced-*"))


def test_force_moves_nothing_through_a_symbolic_link_in_out(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "precious.txt"
    victim.write_text("keep\n")
    records = expand(SweepSpec(algorithms=("respo",), reuse=(8,), seeds=(0,), out_dir=out), compose=False)
    (out / "logs").mkdir(parents=True)
    (out / "logs" / f"{records[0].name}.jsonl").symlink_to(victim)
    with pytest.raises(SweepConflict, match="symbolic link"):
        replace_sweep(records, out)
    assert victim.read_text() == "keep\n"


def test_force_with_print_moves_nothing_and_keeps_the_manifest(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main([*GRID, "--print", "--out", str(out), "--", "trainer.nnodes=1"]) == 0
    old = read_manifest(out / MANIFEST_NAME)
    log = out / "logs" / f"{old[0].name}.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text(json.dumps({"step": 1, "data": {"x": 1.0}}) + "\n")
    capsys.readouterr()
    for flag in ("--print", "--dry-run"):
        assert cli_main([*GRID, flag, "--force", "--out", str(out), "--", "trainer.nnodes=2"]) == 2
        err = capsys.readouterr().err
        assert f"# --force would move {log}" in err and "moves nothing" in err
        assert log.is_file() and not list(out.glob("replaced-*"))
        assert read_manifest(out / MANIFEST_NAME) == old


def _hold_lock(out: Path, holder: dict) -> int:
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps(holder).encode())
    return fd


@pytest.mark.parametrize("holder", ["sweep", "run of a stopped sweep"])
def test_force_refuses_while_the_lock_is_held(tmp_path, capsys, holder):
    """This test's process holds the lock, standing for a live sweep or for the run a killed sweep left saving."""
    out = tmp_path / "out"
    assert cli_main([*GRID, "--print", "--out", str(out), "--", "trainer.nnodes=1"]) == 0
    name = read_manifest(out / MANIFEST_NAME)[0].name
    log = out / "logs" / f"{name}.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text(json.dumps({"step": 1, "data": {"x": 1.0}}) + "\n")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    if holder == "sweep":
        record = {"sweep_pid": os.getpid()}
    else:
        record = {"sweep_pid": int(dead.stdout), "run": name, "run_pid": os.getpid()}
    fd = _hold_lock(out, record)
    capsys.readouterr()
    try:
        assert cli_main([*GRID, "--force", "--out", str(out), "--", "trainer.nnodes=2"]) == 2
    finally:
        os.close(fd)
    (line,) = capsys.readouterr().err.splitlines()
    expected = "another sweep (pid" if holder == "sweep" else f"is held by run {name}"
    assert line.startswith("respo-verl sweep: ") and expected in line, line
    assert log.is_file() and not list(out.glob("replaced-*"))


@pytest.mark.parametrize("model", ["../x", "a/b", "..", ".hidden", "a b", "", "x\\y"])
def test_a_model_name_that_is_not_a_plain_name_is_refused(tmp_path, capsys, model):
    out = tmp_path / "out"
    assert cli_main([*GRID, "--print", "--model", model, "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"respo-verl sweep: --model {model!r} is not a plain name"), line
    assert not out.exists() and not (tmp_path / "x").exists()


def test_a_manifest_with_a_run_name_that_leaves_its_folder_is_refused(tmp_path):
    record = RunRecord("m-respo-n8-s0", "respo", 8, 0, "logs/m.jsonl", 1024, "h")
    path = write_manifest([record], tmp_path)
    path.write_text(path.read_text().replace('"m-respo-n8-s0"', '"../../m-respo-n8-s0"'))
    with pytest.raises(ValueError, match=r"manifest.jsonl:1: run name '\.\./\.\./m-respo-n8-s0' is not a plain name"):
        read_manifest(path)


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path, capsys):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("do not truncate\n")
    (out / LOCK_NAME).symlink_to(victim)
    assert cli_main([*GRID, "--out", str(out)]) == 2  # refused before any run starts
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"respo-verl sweep: {out / LOCK_NAME} is a symbolic link; the sweep writes its lock through none: " \
        "remove it"  # fmt: skip
    assert victim.read_text() == "do not truncate\n"


def test_a_symlinked_manifest_is_replaced_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    (tmp_path / MANIFEST_NAME).symlink_to(victim)
    records = expand(SweepSpec(algorithms=("respo",), reuse=(8,), seeds=(0,), out_dir=tmp_path), compose=False)
    write_manifest(records, tmp_path)
    assert victim.read_text() == "keep\n"
    assert not (tmp_path / MANIFEST_NAME).is_symlink() and read_manifest(tmp_path / MANIFEST_NAME) == records


def test_an_interrupt_before_the_run_is_recorded_still_stops_it():
    """SIGTERM reaches the sweep after it decided to start a run but before it recorded the run's process."""
    interrupts = _Interrupts(echo=lambda line: None)
    interrupts._handle(signal.SIGTERM, None)  # the handler, as Python calls it, with no run recorded yet
    child = subprocess.Popen(SLEEPER)
    try:
        interrupts.attach(child, "r")
        assert child.wait(timeout=20) == -signal.SIGTERM
        assert interrupts.messages and interrupts.messages[0].startswith("SIGTERM: stopping r")
        interrupts._handle(signal.SIGTERM, None)  # a second interrupt of an ended run: nothing is signalled twice
    finally:
        child.kill()
        child.wait()


def test_a_run_gets_sigterm_when_its_sweep_is_killed(tmp_path):
    """The run's start (:func:`start_command`, no pre-exec function) ties it to the sweep: a SIGKILLed sweep's run
    gets SIGTERM from the kernel. The "sweep" here is a small Python process that starts the stand-in run."""
    pid_file = tmp_path / "run.pid"
    run = [
        sys.executable,
        "-c",
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)",
    ]
    sweep_code = tmp_path / "sweep.py"
    sweep_code.write_text(
        "import os, subprocess, sys, time\n"
        "from respo_verl.tools.sweep.local import start_command\n"
        f"subprocess.Popen(start_command({run!r}, os.getpid()))\n"
        "time.sleep(60)\n"
    )
    sweep = subprocess.Popen([sys.executable, str(sweep_code)])
    try:
        deadline = time.monotonic() + 20
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        run_pid = int(pid_file.read_text())
        sweep.kill()
        sweep.wait()
        assert procs.gone_within(run_pid, 20.0), "the run outlived its killed sweep"
    finally:
        sweep.kill()
