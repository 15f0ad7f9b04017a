"""The `respo-verl` console script: a command is required, unknown commands and --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from respo_verl.cli import SUBCOMMANDS, main


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("respo-verl: a command is required")
    assert all(name in captured.err for name in SUBCOMMANDS)


def test_unknown_command_is_a_usage_error(capsys):
    assert main(["plot"]) == 2
    assert "respo-verl: unknown command 'plot'" in capsys.readouterr().err


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: respo-verl <command>") and all(name in out for name in SUBCOMMANDS)


def test_console_script_exit_status_without_a_command():
    done = subprocess.run([sys.executable, "-m", "respo_verl.cli"], capture_output=True, text=True)
    assert done.returncode == 2 and "a command is required" in done.stderr


def test_default_output_folders_are_ignored_by_git_and_the_packages_are_not():
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    defaults = ["runs/x.jsonl", "report/report.md", "outputs/mini/x/results.md"]  # sweep, report, mini
    packages = ["respo_verl/tools/runs/manifest.py", "respo_verl/tools/report/cli.py"]
    done = subprocess.run(["git", "check-ignore", *defaults, *packages], cwd=root, capture_output=True, text=True)
    assert done.stdout.split() == defaults


def test_the_miniature_is_not_a_command_of_the_package_and_says_where_it_went(capsys):
    assert main(["mini", "--full"]) == 2
    err = capsys.readouterr().err
    assert "python -m experiments.mini" in err and len(err.strip().splitlines()) == 1
    assert "mini" not in SUBCOMMANDS


def test_prepare_data_lists_its_datasets_and_refuses_an_unknown_one(capsys):
    assert main(["prepare-data", "--help"]) == 0
    assert "dapo-math" in capsys.readouterr().out
    assert main(["prepare-data", "gsm8k"]) == 2
    assert "unknown dataset 'gsm8k'" in capsys.readouterr().err
