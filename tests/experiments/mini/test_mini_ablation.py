"""The branch ablation (``python -m experiments.mini --ablate``): its grid, its paired statistics by hand, its table,
resuming runs that are complete, and the ablation presets beside (not among) the default algorithms."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from experiments.mini import cli as mini_cli
from experiments.mini import experiment, protocol, summary
from experiments.mini import model as model_lib
from experiments.mini.cli import main
from experiments.mini.train import RunConfig
from respo_verl import algorithms


def test_ablation_presets_are_known_but_not_default():
    assert algorithms.ABLATIONS == ("respo_pos", "respo_neg", "phi_one", "grpo_noclip")
    assert not set(algorithms.ABLATIONS) & set(algorithms.ALGORITHMS)
    assert algorithms.ALGORITHMS == ("respo", "vespo", "grpo", "gspo")
    colors = {algorithms.get(a).color for a in (*algorithms.ALGORITHMS, *algorithms.ABLATIONS)}
    assert len(colors) == 8
    assert sorted(protocol.ABLATION, key=algorithms.order) == list(protocol.ABLATION)
    assert algorithms.parse_list("respo_pos,phi_one") == ("respo_pos", "phi_one")


def test_ablate_resolves_to_its_grid():
    args = mini_cli.resolve(mini_cli.build_parser().parse_args(["--ablate"]))
    assert args.algos == ["respo", "vespo", "respo_pos", "respo_neg", "phi_one", "grpo_noclip"]
    # The verdict's common rate and seeds: 2 warm starts × 4 RL seeds.
    assert (args.reuse, args.lr, args.seeds, args.optimizer_steps) == ([32], [4e-4], list(range(8)), 192)
    assert args.resume and args.workers == 2
    reduced = mini_cli.resolve(mini_cli.build_parser().parse_args(["--ablate", "--seeds", "0,1,2,3"]))
    assert reduced.seeds == [0, 1, 2, 3] and sorted({protocol.warm_seed(s) for s in reduced.seeds}) == [0, 1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ablate", "--full"], "--ablate runs the ablate grid"),
        (["--ablate", "--algos", "respo"], "--ablate runs the ablate grid"),
        (["--ablate", "--lr", "3e-4"], "--ablate runs the ablate grid"),
        (["--grid", "trend", "--optimizer-steps", "64"], "--grid trend runs the trend grid"),
        (["--ablate", "--moe"], "it takes no --moe"),
        (["--ablate", "--grid", "horizon"], "--ablate is --grid ablate"),
        (["--grid", "horizon", "--seeds", "9"], "the horizon grid has no run with them"),
        (["--algos", "respo,phi_one"], "phi_one: the ablation presets run through --grid ablate"),
    ],
)
def test_bad_ablation_options_are_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_paired_difference_by_hand():
    # d = (2, 3, 1, 4): mean 2.5, sd = √(5/3) = 1.2909944, se = sd/2 = 0.6454972, t(0.975, 3) = 3.1824463,
    # half-width 2.0542603.
    d = summary.paired_difference([3.0, 5.0, 4.0, 6.0], [1.0, 2.0, 3.0, 2.0])
    assert (d.n, d.mean) == (4, 2.5)
    assert d.sd == pytest.approx(math.sqrt(5 / 3), rel=1e-12)
    assert (d.low, d.high) == (pytest.approx(2.5 - 2.0542603, abs=1e-6), pytest.approx(2.5 + 2.0542603, abs=1e-6))
    one = summary.paired_difference([1.0], [0.5])
    assert one.mean == 0.5 and math.isnan(one.low) and math.isnan(one.high)
    with pytest.raises(ValueError, match="paired values"):
        summary.paired_difference([1.0, 2.0], [1.0])


def test_paired_interval_is_narrower_than_welch_when_seeds_share_their_noise():
    from respo_verl.tools.report.analysis import welch_interval

    base = [0.60, 0.70, 0.65, 0.75]
    shifted = [b + 0.01 + 0.001 * i for i, b in enumerate(base)]
    paired = summary.paired_difference(shifted, base)
    low, high = welch_interval(shifted, base)
    assert paired.low > 0 > low and high - low > paired.high - paired.low


def test_ablation_table_decomposes_the_gap_per_seed():
    late = {
        "respo": {0: 0.72, 1: 0.74},
        "vespo": {0: 0.71, 1: 0.72},
        "respo_pos": {0: 0.715, 1: 0.73},
        "respo_neg": {0: 0.71, 1: 0.725},
        "phi_one": {0: 0.70, 1: 0.70},
        "grpo_noclip": {0: 0.5, 1: 0.6},
    }
    text = "\n".join(summary.ablation_markdown(late, 4e-4, 32))
    assert "RL seeds 0, 1 (warm starts 0, 1" in text and "2 paired seeds" in text
    assert "| ReSPO (`respo`) | 2 | 73.00 | 1.41 |" in text
    assert "| GRPO no clip (`grpo_noclip`) | 2 | 55.00 | 7.07 |" in text
    # ReSPO − VESPO: per seed +1.00, +2.00 pp; mean +1.50; paired 95 % t (1 dof): ±12.706·0.5.
    assert "| ReSPO − VESPO (the gap) | +1.50 | [-4.85, +7.85] | +1.00, +2.00 |" in text
    assert "| respo_pos − VESPO (positive branch's share) | +0.75 |" in text
    assert "| respo_neg − VESPO (negative branch's share) | +0.25 |" in text


def _tiny_job(tmp_path, algorithm="respo_pos"):
    cfg = RunConfig(algorithm, reuse=2, seed=0, optimizer_steps=2, rollout_prompts=2, group_size=4, lr=4e-4)
    warm = model_lib.WarmStart(steps=3, batch_size=16)
    return experiment.Job(cfg, model_lib.ModelSpec(), warm, tmp_path / "cache", tmp_path / "out", 1, False)


def test_a_complete_run_is_skipped_and_an_incomplete_one_is_redone(tmp_path, monkeypatch, capsys):
    job = _tiny_job(tmp_path)
    bar = SimpleNamespace(update=lambda n: None, set_description=lambda text: None)
    assert experiment.completed(job) is None
    (first,) = experiment.execute([job], 1, bar, resume=True)
    again = experiment.completed(job)
    assert again is not None and again.regime == first.regime and again.stale_shares == first.stale_shares
    assert (again.first_score, again.wall_s, again.log) == (first.first_score, first.wall_s, first.log)

    def fail(*args, **kwargs):
        raise AssertionError("a complete run must not run again")

    monkeypatch.setattr(experiment, "run_job", fail)
    (skipped,) = experiment.execute([job], 1, bar, resume=True)
    assert (skipped.name, skipped.regime, skipped.log) == (again.name, again.regime, again.log)
    assert "complete in" in capsys.readouterr().out
    # Another setting with the same name's log is not complete for this job; a truncated log is not complete.
    other = experiment.Job(**{**job.__dict__, "cfg": RunConfig(**{**job.cfg.__dict__, "weight_decay": 0.0})})
    assert experiment.completed(other) is None
    lines = first.log.read_bytes().splitlines()
    first.log.write_bytes(lines[0] + b"\n")
    assert experiment.completed(job) is None
