"""The named grids of ``python -m experiments.mini --grid``: the trend and horizon grids' runs, the held-out problems
and their evaluation, the paired statistics (sign-flip test, per warm start) by hand, and the grids' tables."""

from __future__ import annotations

import itertools
import re
import statistics

import orjson
import pytest
import torch

from experiments.mini import cli as mini_cli
from experiments.mini import experiment, protocol, summary, task
from experiments.mini import model as model_lib
from experiments.mini.train import EVAL_SAMPLES, RunConfig, train


def _resolve(*argv: str):
    return mini_cli.resolve(mini_cli.build_parser().parse_args(list(argv)))


def test_trend_grid_is_three_methods_at_three_n_with_the_verdicts_seeds():
    args = _resolve("--grid", "trend")
    assert args.algos == ["respo", "vespo", "respo_pos"] and args.reuse == [8, 16, 32]
    assert (args.lr, args.seeds, args.optimizer_steps, args.held_out) == ([4e-4], list(range(8)), 192, False)
    assert len(args.runs) == 3 * 3 * 8 and len(set(args.runs)) == len(args.runs)
    # Its N = 32 runs are the ablation's: the same configurations, so a trend in the ablation's folder reuses them.
    ablate = _resolve("--ablate")
    assert {r for r in args.runs if r[1] == 32} <= set(ablate.runs)
    assert args.resume


def test_horizon_grid_is_the_papers_1024_updates_with_grpo_on_half_the_seeds():
    args = _resolve("--grid", "horizon")
    assert (args.reuse, args.optimizer_steps, args.held_out) == ([32], 1024, True)
    per_method = {a: sorted(s for m, _, _, s in args.runs if m == a) for a in args.algos}
    assert per_method == {"respo": list(range(8)), "vespo": list(range(8)), "grpo": [0, 1, 2, 3]}
    # Both warm starts in GRPO's four seeds, and the first seeds of every method first (a reduced grid is paired).
    assert {protocol.warm_seed(s) for s in per_method["grpo"]} == {0, 1}
    assert [s for _, _, _, s in args.runs] == sorted(s for _, _, _, s in args.runs)
    half = _resolve("--grid", "horizon", "--seeds", "4,5,6,7")
    assert {a for a, _, _, _ in half.runs} == {"respo", "vespo"} and half.seeds == [4, 5, 6, 7]
    assert {c.name for c in _session_configs(args)} >= {"respo_n32_lr4e-04_w1_seed3_ho"}


def _session_configs(args):
    return [
        RunConfig(a, n, s, args.optimizer_steps, args.minibatch_prompts * n, args.group_size, lr,
                  warm_seed=protocol.warm_seed(s), held_out=args.held_out)
        for a, n, lr, s in args.runs
    ]  # fmt: skip


def test_estimate_scales_with_updates_and_workers():
    horizon, ablate = protocol.GRIDS["horizon"], protocol.GRIDS["ablate"]
    assert ablate.estimate_s(48, 2) == 24 * protocol.RUN_SECONDS_ESTIMATE
    assert horizon.estimate_s(3, 2) == pytest.approx(2 * protocol.RUN_SECONDS_ESTIMATE * 1024 / 192)


def test_held_out_problems_are_a_fixed_fifth_never_drawn_for_training():
    held = task.held_out_problems()
    assert held.numel() == task.N_HELD_OUT == 25 and held.unique().numel() == 25
    assert torch.equal(held, task.held_out_problems()), "one fixed draw"
    digits = task.problem_digits(torch.tensor([0, 1, 5, 31, 124]))
    assert digits.tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 1, 1], [4, 4, 4]]
    drawn = task.sample_training_prompts(4000, torch.Generator().manual_seed(0)).digits
    ids = (drawn * torch.tensor([25, 5, 1])).sum(dim=1)
    assert not torch.isin(ids, held).any() and ids.unique().numel() == 100
    prompts = task.prompts_of(task.problem_digits(held))
    assert torch.equal(prompts.input_ids[:, 1:-1], task.digit(task.problem_digits(held)))


def test_config_hash_of_runs_made_before_held_out_existed_is_unchanged():
    import hashlib
    import json
    from dataclasses import asdict

    cfg = RunConfig("respo", 32, 3, 192, 128, 8, 4e-4, warm_seed=1)
    # the fields of the runs made before held_out (and task) existed
    before = {k: v for k, v in asdict(cfg).items() if k not in ("seed", "warm_seed", "held_out", "task")}
    expected = hashlib.sha256(json.dumps(before, sort_keys=True, default=str).encode()).hexdigest()
    assert experiment.config_hash(cfg) == expected
    assert experiment.config_hash(RunConfig(**{**cfg.__dict__, "held_out": True})) != expected
    assert experiment.config_hash(RunConfig(**{**cfg.__dict__, "task": "fork"})) != expected
    assert cfg.name == "respo_n32_lr4e-04_w1_seed3"


def test_run_names_keep_every_digit_of_the_learning_rate():
    from experiments.mini.train import lr_label
    from respo_verl.tools.report.analysis import NAME_PATTERN

    # one-digit rates keep the names of every earlier run; others keep the digits they need, and no more
    assert [lr_label(lr) for lr in (4e-4, 3e-4, 1e-4, 3.5e-4, 3.25e-4, 0.1 + 0.2)] == [
        "4e-04",
        "3e-04",
        "1e-04",
        "3.5e-04",
        "3.25e-04",
        "3.0000000000000004e-01",
    ]
    names = {RunConfig("respo", 32, 0, 192, 128, 8, lr).name for lr in (3e-4, 3.5e-4, 3.25e-4)}
    assert names == {"respo_n32_lr3e-04_w0_seed0", "respo_n32_lr3.5e-04_w0_seed0", "respo_n32_lr3.25e-04_w0_seed0"}
    # the report reads the rate back from the name, exactly
    read = {float(NAME_PATTERN.search(name)["lr"]) for name in names}
    assert read == {3e-4, 3.5e-4, 3.25e-4}
    for bad in (0.0, -1e-4, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="learning rate must be a positive number"):
            lr_label(bad)


def test_two_runs_that_would_share_a_log_are_refused_before_any_runs(tmp_path):
    cfg = RunConfig("respo", 32, 0, 192, 128, 8, 3e-4)
    warm = model_lib.WarmStart(seed=0, steps=1)
    job = experiment.Job(cfg, model_lib.ModelSpec(), warm, tmp_path / "cache", tmp_path / "out", 1, False)
    twin = experiment.Job(**{**job.__dict__, "cfg": RunConfig(**{**cfg.__dict__, "weight_decay": 0.0})})
    with pytest.raises(ValueError, match=r"two runs would write the same log .*respo_n32_lr3e-04_w0_seed0\.jsonl"):
        experiment.execute([job, twin], workers=2, bar=None)
    assert not (tmp_path / "out").exists()  # nothing ran


def test_a_held_out_run_scores_its_final_policy_on_the_held_out_problems(tmp_path):
    torch.use_deterministic_algorithms(True)
    base, _ = model_lib.warm_start(model_lib.ModelSpec(), model_lib.WarmStart(steps=3, batch_size=16), cache_dir=None)
    cfg = RunConfig("respo", reuse=2, seed=0, optimizer_steps=4, rollout_prompts=2, group_size=4, lr=4e-4,
                    held_out=True)  # fmt: skip
    seen = []
    result = train(cfg, base, tmp_path, on_update=lambda event: seen.append(event.rollout.prompts.digits))
    held = task.held_out_problems()
    assert not any(torch.isin((d * torch.tensor([25, 5, 1])).sum(dim=1), held).any() for d in seen)
    records = [orjson.loads(line) for line in result.log_path.read_bytes().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all("mini/eval/score" not in r["data"] for r in records[:-1])
    last = records[-1]["data"]
    assert last["mini/eval/responses"] == task.N_HELD_OUT * EVAL_SAMPLES
    assert 0.0 <= last["mini/eval/score"] <= 1.0
    assert result.log_path.name == "respo_n2_lr4e-04_w0_seed0_ho.jsonl"
    # One fixed sampling stream: a model scored twice gets one score, so two runs' final policies are compared on
    # the same random numbers.
    from experiments.mini.train import evaluate

    assert evaluate(base) == evaluate(base)


def test_sign_flip_p_by_hand():
    # d = (1, 2, 3): |mean| 2; of the 8 sign assignments only (+,+,+) and (−,−,−) reach |mean| 2.
    assert summary.sign_flip_p([1.0, 2.0, 3.0]) == 2 / 8
    # d = (1, −1): every assignment has |mean| 0 or 1 ≥ 0.
    assert summary.sign_flip_p([1.0, -1.0]) == 1.0
    # Eight positive differences: 2/256, the smallest p eight pairs can give.
    assert summary.sign_flip_p([0.6, 1.2, 0.1, 0.8, 0.6, 0.3, 1.1, 1.0]) == 2 / 256
    # Against a brute-force count on a mixed example.
    d = [0.5, -0.2, 0.9, 0.1, -0.4]
    count = sum(
        abs(statistics.fmean(s * x for s, x in zip(signs, d))) >= abs(statistics.fmean(d)) - 1e-12
        for signs in itertools.product((1, -1), repeat=5)
    )
    assert summary.sign_flip_p(d) == count / 32
    with pytest.raises(ValueError, match="1 to 20"):
        summary.sign_flip_p([])


def test_paired_row_gives_the_mean_per_warm_start():
    # Seeds 0, 2 start from warm start 0, seeds 1, 3 from warm start 1.
    a = {0: 0.72, 1: 0.70, 2: 0.74, 3: 0.69}
    b = {0: 0.71, 1: 0.71, 2: 0.72, 3: 0.69}
    row = summary.paired_row("x", a, b)
    # Differences +1, −1, +2, 0 pp: mean +0.50; w0 mean +1.50, w1 −0.50. Sign flips: the sums ±1 ±1 ±2 are
    # 4, 0, 2, −2, 2, −2, 0, −4 (the 0 pp pair's sign changes nothing), |sum| ≥ 2 in 6 of 8: p = 0.750.
    assert row.startswith("| x | 4 | +0.50 | [")
    assert "| 0.750 | w0: +1.50, w1: -0.50 | +1.00, -1.00, +2.00, +0.00 |" in row
    with pytest.raises(ValueError, match="no seed has both"):
        summary.paired_row("x", {0: 1.0}, {1: 1.0})


def test_grid_markdown_on_hand_values():
    scores = {
        ("respo", 8): {"late": {0: 0.70, 1: 0.72}, "starved": {0: 0.30, 1: 0.20}},
        ("vespo", 8): {"late": {0: 0.69, 1: 0.72}, "starved": {0: 0.10, 1: 0.10}},
        ("respo_pos", 8): {"late": {0: 0.70, 1: 0.71}, "starved": {0: 0.20, 1: 0.20}},
        ("respo", 32): {"late": {0: 0.74, 1: 0.75}, "starved": {0: 0.40, 1: 0.30}},
        ("vespo", 32): {"late": {0: 0.71, 1: 0.73}, "starved": {0: 0.20, 1: 0.20}},
    }
    text = "\n".join(summary.grid_markdown(protocol.GRIDS["trend"], scores))
    assert "| ReSPO | 8 | 2 | 71.00 ± 1.41 | 25.00 ± 7.07 |" in text
    assert "| VESPO | 32 | 2 | 72.00 ± 1.41 | 20.00 ± 0.00 |" in text
    assert "held-out" not in text and "RL seeds run: 0, 1;" in text
    assert "| ReSPO+ / VESPO− | 8 | 2 | 70.50 ± 0.71 | 20.00 ± 0.00 |" in text
    assert "| respo_pos − VESPO, N = 8 | 2 | +0.00 |" in text
    # ReSPO − VESPO at N = 8: +1, 0 pp; at N = 32: +3, +2 pp; the change: +2, +2 pp.
    assert "| ReSPO − VESPO, N = 8 | 2 | +0.50 |" in text
    assert "| ReSPO − VESPO, N = 32 | 2 | +2.50 |" in text
    assert "| (ReSPO − VESPO at N = 32) − (at N = 8) | 2 | +2.00 |" in text
    horizon = {
        ("respo", 32): {"late": {0: 0.74, 1: 0.75}, "eval": {0: 0.80, 1: 0.70}},
        ("vespo", 32): {"late": {0: 0.71, 1: 0.73}, "eval": {0: 0.75, 1: 0.70}},
        ("grpo", 32): {"late": {0: 0.60}, "eval": {0: 0.50}},
    }
    text = "\n".join(summary.grid_markdown(protocol.GRIDS["horizon"], horizon))
    assert "held-out score (%) |" in text and "| GRPO | 32 | 1 | 60.00 ± nan | — | 50.00 ± nan |" in text
    assert "| ReSPO − VESPO, N = 32, held-out | 2 | +2.50 |" in text
    assert "| GRPO − VESPO, N = 32 | 1 | -11.00 |" in text


@pytest.mark.slow
def test_a_grid_writes_its_manifest_and_report_with_the_ablation_presets(tmp_path, monkeypatch):
    """A named grid end to end (a tiny one put in place of the protocol's, one rollout batch of 2 updates per run):
    its manifest lists the ablation preset's run, and ``respo-verl report`` on the grid names it and compares it with
    VESPO."""
    from respo_verl.tools.runs.manifest import MANIFEST_NAME, read_manifest

    tiny = protocol.Grid(
        "tiny", tuple((a, (2,), (0,)) for a in ("respo", "vespo", "respo_pos")), 2, False, "a tiny grid"
    )
    monkeypatch.setitem(protocol.GRIDS, "tiny", tiny)
    out = tmp_path / "tiny"
    assert mini_cli.main(["--grid", "tiny", "--out", str(out), "--workers", "1", "--no-progress"]) == 0
    records = read_manifest(out / MANIFEST_NAME)
    assert sorted(r.algorithm for r in records) == ["respo", "respo_pos", "vespo"]
    report = (out / "report" / "tiny" / "report.md").read_text()
    # its late score beside its difference to VESPO at the same N (the report's comparison cell)
    assert re.search(r"\| ReSPO\+ / VESPO− \| [0-9.]+ \(n=1\)<br>[+−-][0-9.]+ pp \|", report), report
    assert "## Report: tiny" in (out / "results.md").read_text()
