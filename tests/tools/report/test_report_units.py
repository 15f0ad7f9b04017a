"""`respo-verl report` never prints a wrong number: step units, the starved-mass plot's axis, reward ranges, paths."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from support.report_logs import runs_and_logs

from respo_verl import algorithms
from respo_verl.cli import main as cli_main
from respo_verl.run.resolvers import run_name
from respo_verl.tools.report.analysis import (
    LOSS_OWN,
    GroupKey,
    RunIdentity,
    parse_run_name,
    summarise_groups,
    summarise_run,
)
from respo_verl.tools.report.render import (
    ZERO_PLOT_TOP,
    _short_run_note,
    score_figure,
    starved_mass_bands,
    starved_mass_figure,
)
from respo_verl.tools.runs.logs import read_log
from respo_verl.tools.runs.manifest import RunRecord, write_manifest

N = 8
UPDATES = 64


def per_update_log(path: Path, early: float, late: float, starved: float | None = None) -> Path:
    """A per-update log as the miniature writes it: reward ``early`` for the first half, ``late`` after."""
    lines = []
    for step in range(1, UPDATES + 1):
        data = {"critic/score/mean": early if step <= UPDATES // 2 else late, "mini/optimizer_step": step}
        data |= {"mini/reuse": N, "training/global_step": (step - 1) // N + 1}
        if starved is not None:
            data["actor/respo/starved_mass_share"] = starved
        lines.append(json.dumps({"step": step, "data": data}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def mini_folder(tmp_path: Path) -> Path:
    """Logs named as the mini names them, in ``<out>/respo_verl_mini``, without the manifest next to them."""
    folder = tmp_path / "respo_verl_mini"
    for seed in range(2):
        per_update_log(folder / f"respo_n{N}_seed{seed}.jsonl", early=-1.0, late=1.0, starved=0.2 + 0.1 * seed)
        per_update_log(folder / f"vespo_n{N}_seed{seed}.jsonl", early=1.0, late=-1.0, starved=0.1)
    return folder


def test_per_update_logs_without_a_manifest_are_read_per_update(tmp_path):
    out = tmp_path / "report"
    assert cli_main(["report", str(mini_folder(tmp_path)), "--out", str(out), "--no-plots"]) == 0
    text = (out / "report.md").read_text()
    # 64 updates: late = all 64 (shorter than 128) = mean of 0 and 1 for both; early = first 64 as well.
    assert "| ReSPO | 50.00 ± 0.00 (n=2)<br>+0.00 pp" in text
    assert "All runs have at most 256 optimizer updates: for them the early window is the whole run" in text
    log = read_log(tmp_path / "respo_verl_mini" / f"respo_n{N}_seed0.jsonl")
    summary = summarise_run(log, None)
    assert summary.log_step == "optimizer" and len(summary.curve) == UPDATES
    assert summary.curve[:32] == [0.0] * 32 and summary.curve[32:] == [1.0] * 32


def test_manifest_and_log_disagreeing_on_the_step_unit_is_refused(tmp_path, capsys):
    per_update_log(tmp_path / "logs" / "m-respo-n8-s0.jsonl", -1.0, 1.0)
    write_manifest([RunRecord("m-respo-n8-s0", "respo", N, 0, "logs/m-respo-n8-s0.jsonl", UPDATES, "h")], tmp_path)
    assert cli_main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "manifest says one line per training step" in err and len(err.strip().splitlines()) == 1


def test_a_log_whose_n_contradicts_its_name_is_refused(tmp_path, capsys):
    per_update_log(tmp_path / "respo_n16_seed0.jsonl", -1.0, 1.0)  # the log says N = 8
    assert cli_main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert "the file name says N = 16, the log says N = 8" in capsys.readouterr().err


def _groups(folder: Path):
    return summarise_groups(*runs_and_logs(folder))[0]


def test_starved_mass_plot_is_one_mean_line_per_group_over_the_updates_run(tmp_path):
    groups = _groups(mini_folder(tmp_path))
    bands = starved_mass_bands(groups, LOSS_OWN)
    assert set(bands) == {GroupKey("respo", N, None, "off"), GroupKey("vespo", N, None, "off")}
    respo = bands[GroupKey("respo", N, None, "off")]
    assert respo.steps == list(range(1, UPDATES + 1)) and respo.seeds == 2
    assert respo.mean[0] == pytest.approx(0.25) and respo.high[0] - respo.mean[0] == pytest.approx(0.0707107, abs=1e-6)
    fig = starved_mass_figure(groups, LOSS_OWN)
    (ax,) = fig.axes
    assert len(ax.get_lines()) == 2
    assert ax.get_xlim() == (1, UPDATES)
    assert max(max(line.get_xdata()) for line in ax.get_lines()) == UPDATES


def test_starved_mass_plot_of_training_step_logs_spans_the_updates(tmp_path):
    rows = [json.dumps({"step": s, "data": {"critic/score/mean": 0.0, "actor/vespo/starved_mass_share": 0.1}})
            for s in range(1, 5)]  # fmt: skip
    (tmp_path / "m-vespo-n8-s0.jsonl").write_text("\n".join(rows) + "\n")
    bands = starved_mass_bands(_groups(tmp_path), LOSS_OWN)
    assert bands[GroupKey("vespo", N, "m", "off")].steps == list(range(1, 4 * N + 1))  # 4 training steps of 8 updates


def test_reward_range_01_on_pm1_logs_is_refused(tmp_path, capsys):
    folder = mini_folder(tmp_path)
    assert cli_main(["report", str(folder), "--reward-range", "01", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "lies outside the declared reward range [0, 1]" in err
    assert not (tmp_path / "r").exists()


def test_missing_manifest_is_one_line_and_exit_2(tmp_path, capsys):
    folder = mini_folder(tmp_path)
    code = cli_main(["report", str(folder), "--manifest", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.strip() == f"respo-verl report: --manifest {tmp_path / 'nope.jsonl'}: no such file"


def test_out_under_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    folder = mini_folder(tmp_path)
    (tmp_path / "file").write_text("")
    assert cli_main(["report", str(folder), "--out", str(tmp_path / "file" / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"respo-verl report: --out {tmp_path / 'file' / 'r'}: cannot write there")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_out_in_an_unwritable_place_is_one_line_and_exit_2(tmp_path, capsys):
    folder = mini_folder(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert cli_main(["report", str(folder), "--out", str(locked / "r")]) == 2
    assert "cannot write there" in capsys.readouterr().err


def test_the_early_window_caveat_counts_the_short_runs_and_is_absent_without_them(tmp_path):
    """The legend says which runs are no longer than the early window (their early score is their AUC)."""
    short = summarise_run(read_log(per_update_log(tmp_path / "respo_n8_seed0.jsonl", early=-1.0, late=1.0)), None)
    long = dataclasses.replace(short, name="respo_n8_seed1", curve=short.curve * 5)  # 320 updates
    assert _short_run_note([short, long]) == (
        " 1 of 2 runs have at most 256 optimizer updates: for them the early window is the whole run, so their "
        "early score is their AUC."
    )
    assert _short_run_note([long]) == ""


@pytest.mark.parametrize("routing", [None, "r2", "r3"])
@pytest.mark.parametrize("algorithm", algorithms.NAMES)
def test_the_run_name_scheme_is_read_back_from_a_log_name(algorithm, routing):
    """The one scheme (respo_verl.run.resolvers.run_name), a model folder's name with dots and dashes as its model,
    and the routing replay mode its suffix says (none: off)."""
    name = run_name("Qwen3-30B-A3B-Base", algorithm, 16, 42, routing)
    assert parse_run_name(name) == RunIdentity(algorithm, 16, 42, model="Qwen3-30B-A3B-Base", routing=routing or "off")


def test_the_miniature_s_log_names_are_parsed():
    """experiments/mini/train.py names its logs ``<algo>_n<N>_lr<lr:.0e>_w<warm seed>_seed<seed>[_r2]``."""
    assert parse_run_name("respo_n32_lr4e-04_w0_seed0") == RunIdentity("respo", 32, 0, lr=4e-4, warm_seed=0)
    r2 = RunIdentity("vespo", 8, 3, lr=2e-4, warm_seed=1, routing="r2")
    assert parse_run_name("vespo_n8_lr2e-04_w1_seed3_r2") == r2
    assert parse_run_name("vespo_n8_lr2e-04_w1_seed3_r2_ho") == r2  # held out: the routing mode is still read
    assert parse_run_name("qwen3-30b-a3b-gspo-n16-s2") == RunIdentity("gspo", 16, 2, model="qwen3-30b-a3b")
    assert parse_run_name("respo_n32_seed1") == RunIdentity("respo", 32, 1)
    assert parse_run_name("stray") is None


def test_the_presets_former_names_give_their_model_and_routing():
    """The presets named runs ``<algorithm>_n<N>_seed<seed>_<model folder>[_<routing>]`` before run_name."""
    assert parse_run_name("respo_n4_seed1_Qwen3-30B-A3B_r3") == RunIdentity(
        "respo", 4, 1, model="Qwen3-30B-A3B", routing="r3"
    )
    assert parse_run_name("grpo_n32_seed7_Qwen3-1.7B") == RunIdentity("grpo", 32, 7, model="Qwen3-1.7B")
    assert parse_run_name("gspo_n1_seed0_m_r2") == RunIdentity("gspo", 1, 0, model="m", routing="r2")


def test_a_model_named_like_an_algorithm_is_the_model():
    """The algorithm is the first one followed by ``-n<N>``; what comes before it is the model, whatever it says."""
    assert parse_run_name("grpo-distill-respo_pos-n8-s3-r3") == RunIdentity(
        "respo_pos", 8, 3, model="grpo-distill", routing="r3"
    )


def test_a_folder_of_the_miniature_s_logs_without_its_manifest_is_reported(tmp_path):
    """docs/comparing.md's example: `respo-verl report <mini out>/respo_verl_mini` (the logs, no manifest)."""
    folder = tmp_path / "respo_verl_mini"
    for seed in range(2):
        per_update_log(folder / f"respo_n{N}_lr4e-04_w{seed % 2}_seed{seed}.jsonl", -1.0, 1.0, starved=0.2)
        per_update_log(folder / f"vespo_n{N}_lr4e-04_w{seed % 2}_seed{seed}.jsonl", -1.0, -1.0, starved=0.1)
    out = tmp_path / "report"
    assert cli_main(["report", str(folder), "--out", str(out), "--no-plots"]) == 0
    text = (out / "report.md").read_text()
    assert "| ReSPO | 50.00 ± 0.00 (n=2)<br>+50.00 pp" in text
    assert "| VESPO | 0.00 ± 0.00 (n=2) |" in text
    assert "no manifest entry" not in text


def test_the_miniature_s_runs_at_different_learning_rates_are_not_averaged(tmp_path):
    per_update_log(tmp_path / f"respo_n{N}_lr2e-04_w0_seed0.jsonl", -1.0, 1.0)  # logs no actor/lr: the name says it
    per_update_log(tmp_path / f"respo_n{N}_lr4e-04_w1_seed1.jsonl", -1.0, 1.0)
    out = tmp_path / "report"
    assert cli_main(["report", str(tmp_path), "--out", str(out), "--no-plots"]) == 0
    assert f"respo N={N}: not averaged — learning rates differ (file names)" in (out / "report.md").read_text()


def test_no_identified_run_is_one_line_and_exit_2(tmp_path, capsys):
    per_update_log(tmp_path / "logs" / "stray.jsonl", -1.0, 1.0)
    per_update_log(tmp_path / "logs" / "respo_32_0.jsonl", -1.0, 1.0)
    assert cli_main(["report", str(tmp_path / "logs"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"respo-verl report: no run identified in {tmp_path / 'logs'}: read 2 log(s) and 0 manifest")
    assert "respo-n32-s0, respo_n32_seed0, respo_n32_lr4e-04_w0_seed0" in err
    assert not (tmp_path / "r").exists()


def _zero_groups(tmp_path: Path):
    """Two seeds of ReSPO whose score is 0 and whose starved mass share is 0.00 at every update."""
    for seed in range(2):
        per_update_log(tmp_path / f"respo_n{N}_seed{seed}.jsonl", early=-1.0, late=-1.0, starved=0.0)
    return _groups(tmp_path)


def test_a_plot_of_a_metric_that_is_0_throughout_starts_at_0(tmp_path):
    groups = _zero_groups(tmp_path)
    (ax,) = starved_mass_figure(groups, LOSS_OWN).axes
    assert max(max(line.get_ydata()) for line in ax.get_lines()) == 0.0
    assert ax.get_ylim() == (0.0, ZERO_PLOT_TOP)
    (ax,) = score_figure(groups, N).axes
    assert ax.get_ylim() == (0.0, ZERO_PLOT_TOP)


def test_plots_start_at_0_and_keep_room_for_every_panel(tmp_path):
    per_update_log(tmp_path / "respo_n8_seed0.jsonl", early=-1.0, late=1.0, starved=0.3)
    per_update_log(tmp_path / "respo_n16_seed0.jsonl", early=-1.0, late=1.0, starved=0.05)
    for path in tmp_path.glob("respo_n16_*.jsonl"):  # per_update_log writes mini/reuse = 8: make it 16
        path.write_text(path.read_text().replace(f'"mini/reuse": {N}', '"mini/reuse": 16'))
    groups = _groups(tmp_path)
    axes = starved_mass_figure(groups, LOSS_OWN).axes
    assert len(axes) == 2
    for ax in axes:  # shared y-axis: the top fits the larger panel (30 %)
        low, high = ax.get_ylim()
        assert low == 0.0 and 30.0 < high < 35.0
    low, high = score_figure(groups, 8).axes[0].get_ylim()
    assert low == 0.0 and high >= 100.0
