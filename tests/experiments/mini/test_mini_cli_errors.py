"""Invalid options of ``python -m experiments.mini`` fail with one clear line and exit code 2 before any work
starts."""

from __future__ import annotations

import pytest

from experiments.mini import cli as mini_cli
from experiments.mini import protocol
from experiments.mini.cli import main
from respo_verl import algorithms


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--algos", "respo,ppo"], "unknown algorithm"),
        (["--seeds", "-1"], "must be >= 0"),
        (["--reuse", "0"], "must be >= 1"),
        (["--reuse", "8", "16"], "unrecognized arguments: 16"),
        (["--reuse", "8,,16"], "comma-separated list of integers"),
        (["--reuse", "32", "--optimizer-steps", "48"], "multiple of every N"),
        (["--group-size", "1"], "--group-size must be >= 2"),
        (["--lr", "0"], "learning rates must be positive"),
        (["--lr", "1e-4,abc"], "comma-separated learning rates"),
        (["--routing-replay"], "it needs --moe"),
        (["--full", "--reuse", "8"], "--full runs the protocol's grid"),
        (["--full", "--optimizer-steps", "64"], "--full runs the protocol's grid"),
        (["--workers", "0"], "--workers must be >= 1"),
    ],
)
def test_bad_input_is_rejected_before_work(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out), "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert not out.exists() and not (tmp_path / "cache").exists(), "nothing may be written before the check"


@pytest.mark.parametrize("where", ["file", "under_file", "unwritable"])
def test_out_that_cannot_be_a_directory_is_one_line(where, tmp_path, capfd):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    out = {
        "file": a_file,
        "under_file": a_file / "sub" / "out",
        # /proc refuses new directories even to root (for whom os.access says yes): the mkdir error path.
        "unwritable": __import__("pathlib").Path("/proc/respo_verl_mini_test/out"),
    }[where]
    argv = ["--reuse", "2", "--optimizer-steps", "2", "--out", str(out), "--cache-dir", str(tmp_path / "c")]
    assert main(argv) == 2
    captured = capfd.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("python -m experiments.mini: error: --out"), captured.err
    assert not (tmp_path / "c").exists()


def test_list_syntax_is_the_sweeps():
    args = mini_cli.resolve(
        mini_cli.build_parser().parse_args(["--reuse", "8,16", "--seeds", "0,1,2", "--lr", "3e-5,1e-4"])
    )
    assert (args.reuse, args.seeds, args.lr) == ([8, 16], [0, 1, 2], [3e-5, 1e-4])


def test_modes_follow_the_protocol():
    quick = mini_cli.resolve(mini_cli.build_parser().parse_args([]))
    assert (quick.algos, quick.reuse, quick.seeds, quick.lr) == (list(algorithms.ALGORITHMS), [32], [0], [4e-4])
    assert quick.minibatch_prompts >= 4 and quick.optimizer_steps == 192
    full = mini_cli.resolve(mini_cli.build_parser().parse_args(["--full"]))
    assert (full.reuse, full.seeds, full.lr) == ([8, 16, 32], list(range(8)), [2e-4, 3e-4, 4e-4, 5e-4])
    assert sorted({protocol.warm_seed(s) for s in full.seeds}) == [0, 1] and full.optimizer_steps == 192
    assert sorted({protocol.warm_seed(s) for s in protocol.GRID_SEEDS}) == [0, 1]  # the grid sees both warm starts


def test_learning_rate_selection():
    late = {
        ("grpo", 1e-4): 0.30,
        ("grpo", 3e-4): 0.20,
        ("vespo", 1e-4): 0.25,
        ("vespo", 3e-4): 0.40,
        ("gspo", 1e-4): 0.30,
        ("gspo", 3e-4): 0.30,
        ("respo", 1e-4): 0.10,
        ("respo", 3e-4): 0.90,
    }
    assert protocol.best_lr(late, "grpo") == 1e-4 and protocol.best_lr(late, "vespo") == 3e-4
    assert protocol.best_lr(late, "gspo") == 1e-4  # a tie goes to the smaller rate
    # Baselines: mean 0.2833 at 1e-4, 0.30 at 3e-4. ReSPO's scores must play no part.
    assert protocol.common_lr(late) == 3e-4
    assert protocol.common_lr({**late, ("respo", 1e-4): 10.0, ("respo", 3e-4): -10.0}) == 3e-4
    assert protocol.common_lr({k: v for k, v in late.items() if k[0] != "vespo"}) == 1e-4
    with pytest.raises(ValueError, match="baselines"):
        protocol.common_lr({("respo", 1e-4): 0.5})
    # Among the rates in the regime only: there the baselines' best is chosen, whatever the other rates score.
    assert protocol.common_lr(late, eligible=[1e-4]) == 1e-4
    with pytest.raises(ValueError, match="eligible"):
        protocol.common_lr(late, eligible=[1e-3])


def test_rates_in_the_regime_need_every_method_in_it():
    from experiments.mini.regime import RegimeCheck

    def check(starved: float) -> RegimeCheck:
        return RegimeCheck(
            reuse=32, positives=1000, starved_share=starved, tokens_outside_band=0.01, median_single_token_share=0.15
        )

    checks = {(a, lr): check(0.2) for a in algorithms.ALGORITHMS for lr in (2e-4, 3e-4, 4e-4)}
    assert protocol.regime_rates(checks) == [2e-4, 3e-4, 4e-4]
    checks[("gspo", 3e-4)] = check(0.1)  # one method outside the regime at 3e-4 rules that rate out
    assert protocol.regime_rates(checks) == [2e-4, 4e-4]
    assert protocol.regime_rates({k: check(0.1) for k in checks}) == []


def test_full_runs_the_grid_then_the_verdicts_seeds():
    """Stage 1: every method at every rate of the grid, one RL seed per warm start, N = 32. Stage 2, at the common
    rate: ReSPO and VESPO to eight seeds at N = 32 and two seeds at N = 8 and 16; no run is repeated."""
    algos = list(algorithms.ALGORITHMS)
    grid = protocol.grid_runs(algos)
    assert len(grid) == len(algos) * len(protocol.LR_GRID) * 2
    assert {(n, s) for _, n, _, s in grid} == {(32, 0), (32, 1)}
    verdict = protocol.verdict_runs(algos, 3e-4)
    assert {a for a, *_ in verdict} == {"respo", "vespo"} and {lr for _, _, lr, _ in verdict} == {3e-4}
    for algo in ("respo", "vespo"):
        at_common = [(n, s) for a, n, lr, s in grid + verdict if a == algo and lr == 3e-4]
        assert sorted(at_common) == sorted([(32, s) for s in range(8)] + [(n, s) for n in (8, 16) for s in (0, 1)])
    assert len(set(grid + verdict)) == len(grid + verdict)
    # The budget: 52 runs of 192 updates.
    assert (len(grid) + len(verdict)) * protocol.FULL_OPTIMIZER_STEPS == 52 * 192
    assert protocol.verdict_runs(["grpo", "gspo"], 1e-4) == []
