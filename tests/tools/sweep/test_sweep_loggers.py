"""`respo-verl sweep --logger` and a ``trainer.logger=`` override: the trackers a run gets (verl's file log always
among them, since the report reads it), the refusals before anything runs, and a sweep run again with other trackers
accepted as the same sweep. The trackers of real verl runs (TensorBoard) are checked in tests/cpu/test_demo.py."""

from __future__ import annotations

import pytest

from respo_verl.cli import main as cli_main
from respo_verl.run.compose import compose_job
from respo_verl.tools.runs.manifest import read_manifest
from respo_verl.tools.sweep.grid import LOGGER_KEY, VERL_LOGGERS, SweepSpec, expand, run_loggers

PRINT_ONE_RUN = ["sweep", "--print", "--algos", "respo", "--reuse", "8", "--seeds", "0"]


def _loggers_of(command: list[str]) -> list[str]:
    """The value of the one ``trainer.logger=`` word of a run's command, as its names."""
    (word,) = [w for w in command if w.split("=", 1)[0].lstrip("+") == LOGGER_KEY]
    return word.split("=", 1)[1].strip("[]").split(",")


def test_the_accepted_names_are_the_installed_verls_tracking_backends():
    from verl.utils.tracking import Tracking

    assert set(VERL_LOGGERS) == set(Tracking.supported_backend)


@pytest.mark.parametrize(
    ("options", "overrides", "loggers"),
    [
        ([], [], ["console", "file"]),  # verl's default, and the file log the report reads
        (["--logger", "console,file,wandb"], [], ["console", "file", "wandb"]),
        (["--logger", "tensorboard"], [], ["tensorboard", "file"]),
        (["--logger", "wandb,wandb,console"], [], ["wandb", "console", "file"]),
        ([], ["trainer.logger=[wandb]"], ["wandb", "file"]),
        ([], ["trainer.logger=mlflow"], ["mlflow", "file"]),  # one name, as verl also takes it
        ([], ["+trainer.logger=[file, swanlab]"], ["file", "swanlab"]),
    ],
)
def test_each_run_gets_the_user_s_loggers_with_the_file_log_added(tmp_path, capsys, options, overrides, loggers):
    """Through the command line, composed: the manifest's command has one ``trainer.logger=`` word (a user's override
    is replaced by it, not followed by it), and verl's composed job has exactly these loggers."""
    out = tmp_path / "out"
    argv = [*PRINT_ONE_RUN, "--seeds", "0,1", *options, "--out", str(out), "--", *overrides]
    assert cli_main(argv) == 0, capsys.readouterr().err
    records = read_manifest(out / "manifest.jsonl")
    assert len(records) == 2
    for record in records:
        assert _loggers_of(record.command) == loggers
        assert list(compose_job("respo", record.command[3:]).trainer.logger) == loggers


@pytest.mark.parametrize(
    ("options", "overrides", "message"),
    [
        (["--logger", "console,wandbx"], [], "--logger: unknown logger(s) wandbx; verl's are {names}"),
        (
            [],
            ["trainer.logger=[tensorbord,file]"],
            "trainer.logger=[tensorbord,file]: unknown logger(s) tensorbord; verl's are {names}",
        ),
        (["--logger", ","], [], "--logger: no logger named; choose from {names}"),
        (
            ["--logger", "wandb"],
            ["trainer.logger=[tensorboard]"],
            "--logger wandb and trainer.logger=[tensorboard] both name the runs' loggers: give one of them",
        ),
        (
            [],
            ["trainer.logger=[wandb]", "trainer.logger=[mlflow]"],
            "trainer.logger=[wandb] and trainer.logger=[mlflow]: give trainer.logger once",
        ),
        ([], ["~trainer.logger"], "~trainer.logger: a run needs a logger (file at least: the report reads it)"),
        (
            [],
            ["trainer.logger=3"],
            "trainer.logger=3: trainer.logger takes logger names, e.g. trainer.logger=[console,wandb]",
        ),
    ],
)
def test_bad_loggers_are_refused_in_one_line_before_anything_runs(tmp_path, capsys, options, overrides, message):
    """Without --print the sweep would run: the refusal comes first (exit 2, no manifest)."""
    out = tmp_path / "out"
    argv = [o for o in PRINT_ONE_RUN if o != "--print"]
    assert cli_main([*argv, *options, "--out", str(out), "--", *overrides]) == 2
    captured = capsys.readouterr()
    expected = message.format(names=", ".join(VERL_LOGGERS))
    assert captured.err.splitlines() == [f"respo-verl sweep: {expected}"] and captured.out == ""
    assert not out.exists()


def test_the_same_sweep_with_other_trackers_is_accepted_and_keeps_its_hash(tmp_path, capsys):
    """A tracker is not part of a run's identity: neither the configuration hash nor the manifest comparison sees it,
    and the manifest records the trackers of the latest sweep. Anything else that differs is still refused."""
    out = tmp_path / "out"
    argv = [*PRINT_ONE_RUN, "--out", str(out)]
    shared = ["--", "actor_rollout_ref.model.path=/m"]
    assert cli_main([*argv, *shared]) == 0
    (before,) = read_manifest(out / "manifest.jsonl")
    assert cli_main([*argv, "--logger", "console,tensorboard", *shared]) == 0, capsys.readouterr().err
    (after,) = read_manifest(out / "manifest.jsonl")
    assert after.config_hash == before.config_hash != ""
    assert _loggers_of(before.command) == ["console", "file"]
    assert _loggers_of(after.command) == ["console", "tensorboard", "file"]
    assert cli_main([*argv, *shared, "trainer.logger=[wandb]"]) == 0, capsys.readouterr().err
    capsys.readouterr()

    assert cli_main([*argv, "--logger", "wandb", *shared, "actor_rollout_ref.actor.optim.lr=3e-6"]) == 2
    err = capsys.readouterr().err
    assert "here: actor_rollout_ref.actor.optim.lr=3e-6)" in err and "trainer.logger" not in err, err


def test_the_hash_leaves_the_trackers_out_and_nothing_else():
    """The composed jobs of one run with other trackers hash alike; one other key changes the hash."""
    base = ("actor_rollout_ref.model.path=/m",)
    spec = {"algorithms": ("respo",), "reuse": (8,), "seeds": (0,)}
    (plain,) = expand(SweepSpec(**spec, base_overrides=base))
    (tracked,) = expand(SweepSpec(**spec, base_overrides=(*base, "trainer.logger=[tensorboard,wandb]")))
    (other,) = expand(SweepSpec(**spec, base_overrides=(*base, "trainer.nnodes=2")))
    assert tracked.command != plain.command and tracked.config_hash == plain.config_hash
    assert other.config_hash != plain.config_hash


def test_run_loggers_of_a_spec_without_the_command_line():
    """What the demo and other callers of SweepSpec get (the command line passes --logger as ``loggers``)."""
    assert run_loggers(SweepSpec()) == ("console", "file")
    assert run_loggers(SweepSpec(loggers=("file", "tensorboard"))) == ("file", "tensorboard")
    with pytest.raises(ValueError, match=r"^--logger: unknown logger\(s\) tb; "):
        SweepSpec(loggers=("tb",))
