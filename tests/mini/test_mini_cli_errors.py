"""Invalid options of ``respo-verl mini`` fail with a clear message and exit code 2 before any work starts."""

from __future__ import annotations

import pytest

from respo_verl.cli import main
from respo_verl.mini import cli as mini_cli
from respo_verl.verl.experiment import ALGORITHMS


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rollout-prompts", "12", "--reuse", "8"], "does not divide the rollout batch of 12 prompts"),
        (["--algos", "respo,ppo"], "unknown algorithm"),
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--reuse", "0"], "--reuse values must be >= 1"),
        (["--reuse", "32", "--optimizer-steps", "48"], "multiple of every N"),
        (["--group-size", "1"], "--group-size must be >= 2"),
        (["--lr", "0"], "--lr must be a positive number"),
        (["--routing-replay"], "it needs --moe"),
    ],
)
def test_bad_input_is_rejected_before_work(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["mini", *argv, "--out", str(out), "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert not out.exists() and not (tmp_path / "cache").exists(), "nothing may be written before the check"


def test_malformed_option_is_a_usage_error(capsys):
    assert main(["mini", "--reuse", "many"]) == 2
    assert "invalid int value" in capsys.readouterr().err


def test_modes():
    quick = mini_cli.resolve(mini_cli.build_parser().parse_args([]))
    assert (quick.algos, quick.reuse, quick.seeds) == (list(ALGORITHMS), [32], 1)
    full = mini_cli.resolve(mini_cli.build_parser().parse_args(["--full"]))
    assert (full.reuse, full.seeds) == ([8, 16, 32], 3)
    assert mini_cli.ALGORITHMS == ALGORITHMS
