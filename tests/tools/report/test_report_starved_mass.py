"""One starvation measure for every method: the method-independent starved mass share (``mini/diag/``) beside the
loss's own (``actor/<loss>/``), never in one column, and the late-score gap to VESPO against it, on synthetic logs in
the miniature's format with hand-computed answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.report_logs import runs_and_logs

from respo_verl import algorithms
from respo_verl.cli import main as cli_main
from respo_verl.core.diagnostics import INDEPENDENT_STARVED_MASS_KEY
from respo_verl.tools.report.analysis import (
    INDEPENDENT,
    LOSS_OWN,
    GroupKey,
    gap_points,
    parse_run_name,
    summarise_groups,
    summarise_run,
)
from respo_verl.tools.report.render import gap_figure, starved_mass_bands
from respo_verl.tools.runs.logs import read_log

UPDATES = 64  # shorter than the late window: the late score is the mean over the whole run


def key(algorithm: str, reuse: int) -> GroupKey:
    """The group of the miniature's runs: their names say no model and no routing replay."""
    return GroupKey(algorithm, reuse, None, "off")


def mini_log(
    folder: Path,
    algorithm: str,
    reuse: int,
    seed: int,
    *,
    score: float,
    lr: float = 4e-4,
    diag: tuple[float, float] | None = None,
    loss_own: float | None = None,
) -> Path:
    """A log as experiments/mini/train.py writes it: one line per optimizer update, named
    ``<algo>_n<N>_lr<lr:.0e>_w<warm>_seed<seed>``. ``score`` is (reward + 1) / 2 at every update; ``diag`` the
    method-independent starved mass share over the first and the second half of the updates; ``loss_own`` the
    loss's own share (``actor/<algorithm>/starved_mass_share``) at every update."""
    lines = []
    for step in range(1, UPDATES + 1):
        data = {"critic/score/mean": 2 * score - 1, "mini/optimizer_step": step, "mini/reuse": reuse}
        data |= {"training/global_step": (step - 1) // reuse + 1, "actor/lr": lr}
        if diag is not None:
            data[INDEPENDENT_STARVED_MASS_KEY] = diag[0] if step <= UPDATES // 2 else diag[1]
        if loss_own is not None:
            data[f"actor/{algorithm}/starved_mass_share"] = loss_own
        lines.append(json.dumps({"step": step, "data": data}))
    path = folder / f"{algorithm}_n{reuse}_lr{lr:.0e}_w{seed % 2}_seed{seed}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def report(folder: Path, out: Path, *flags: str) -> str:
    assert cli_main(["report", str(folder), "--out", str(out), *flags]) == 0
    return (out / "report.md").read_text()


def _runs_and_logs(folder: Path):
    return runs_and_logs(folder)


def four_methods(folder: Path) -> Path:
    """N = 8, lr 4e-4, two seeds each.

    method-independent share (mean over the run of each seed, then over seeds):
      GRPO (0.30, 0.10) → 0.20 and (0.40, 0.40) → 0.40: 30 %;  GSPO 0.05 and 0.15: 10 %;
      VESPO 0.50 and 0.50: 50 % (its loss's own: 45 %);  ReSPO 0.02 and 0.04: 3 % (its loss's own: 4 %).
    late score: GRPO 0.60, 0.70 → 65 %; GSPO 0.40, 0.50 → 45 %; VESPO 50 %; ReSPO 0.55, 0.65 → 60 %.
    """
    mini_log(folder, "grpo", 8, 0, score=0.60, diag=(0.30, 0.10))
    mini_log(folder, "grpo", 8, 1, score=0.70, diag=(0.40, 0.40))
    mini_log(folder, "gspo", 8, 0, score=0.40, diag=(0.05, 0.05))
    mini_log(folder, "gspo", 8, 1, score=0.50, diag=(0.15, 0.15))
    mini_log(folder, "vespo", 8, 0, score=0.50, diag=(0.50, 0.50), loss_own=0.45)
    mini_log(folder, "vespo", 8, 1, score=0.50, diag=(0.40, 0.60), loss_own=0.45)
    mini_log(folder, "respo", 8, 0, score=0.55, diag=(0.02, 0.02), loss_own=0.04)
    mini_log(folder, "respo", 8, 1, score=0.65, diag=(0.04, 0.04), loss_own=0.04)
    return folder


def test_grpo_and_gspo_get_the_method_independent_starved_mass_next_to_their_score(tmp_path):
    text = report(four_methods(tmp_path / "logs"), tmp_path / "report", "--no-plots")
    header = (
        "| method | N | seeds | late | starved mass (method-independent) | starved mass (loss's own φ) | early | AUC |"
    )
    assert header in text
    assert "| GRPO | 8 | 0,1 | 65.00 | 30.0 | — | 65.00 | 65.00 |" in text
    assert "| GSPO | 8 | 0,1 | 45.00 | 10.0 | — | 45.00 | 45.00 |" in text
    assert "| VESPO | 8 | 0,1 | 50.00 | 50.0 | 45.0 |" in text
    assert "| ReSPO | 8 | 0,1 | 60.00 | 3.0 | 4.0 |" in text
    assert f"starved mass (method-independent) is `{INDEPENDENT_STARVED_MASS_KEY}`" in text


def test_a_log_with_only_the_loss_s_own_share_shows_it_labelled_as_the_loss_s_own(tmp_path):
    """A verl run of respo logs only actor/respo/starved_mass_share: that column, never the method-independent one."""
    folder = tmp_path / "logs"
    mini_log(folder, "respo", 8, 0, score=0.6, loss_own=0.25)
    text = report(folder, tmp_path / "report")
    assert "| ReSPO | 8 | 0 | 60.00 | — | 25.0 |" in text
    assert "starved mass (loss's own φ) is `actor/<loss>/starved_mass_share`" in text
    groups = _groups(folder)
    assert starved_mass_bands(groups, INDEPENDENT) == {}
    assert starved_mass_bands(groups, LOSS_OWN)[key("respo", 8)].mean == pytest.approx([0.25] * UPDATES)
    # One plot file per measure: only the loss's own is logged, so only its plot is written and listed.
    assert (tmp_path / "report" / "starved_mass_share_loss.png").stat().st_size > 0
    assert not (tmp_path / "report" / "starved_mass_share.png").exists()
    assert "- `starved_mass_share_loss.png`: the loss's own starved mass share" in text
    assert "`starved_mass_share.png`" not in text
    assert "No VESPO run was found, so there is no gap to VESPO to plot against starved mass." in text
    assert not (tmp_path / "report" / "gap_vs_starved_mass.png").exists()


def _groups(folder: Path):
    return summarise_groups(*_runs_and_logs(folder))[0]


def test_the_starved_mass_plot_draws_the_method_independent_measure_for_every_method(tmp_path):
    groups = _groups(four_methods(tmp_path / "logs"))
    bands = starved_mass_bands(groups, INDEPENDENT)
    assert set(bands) == {key("respo", 8), key("vespo", 8), key("grpo", 8), key("gspo", 8)}
    half = UPDATES // 2
    assert bands[key("grpo", 8)].mean == pytest.approx(
        [0.35] * half + [0.25] * half
    )  # seeds (0.30, 0.10), (0.40, 0.40)
    assert set(starved_mass_bands(groups, LOSS_OWN)) == {key("respo", 8), key("vespo", 8)}


def test_a_seed_without_the_measure_is_counted_and_its_cell_left_out_of_the_gap_plot(tmp_path):
    folder = tmp_path / "logs"
    mini_log(folder, "grpo", 8, 0, score=0.6, diag=(0.2, 0.2))
    mini_log(folder, "grpo", 8, 1, score=0.6)  # logs no method-independent starved mass share
    mini_log(folder, "vespo", 8, 0, score=0.5, diag=(0.4, 0.4))
    text = report(folder, tmp_path / "report", "--no-plots")
    assert "| GRPO | 8 | 0,1 | 60.00 | 20.0 (1 of 2 runs) | — |" in text
    assert f"- grpo N=8, lr 0.0004: grpo_n8_lr4e-04_w1_seed1 log no {INDEPENDENT_STARVED_MASS_KEY}" in text
    assert gap_points(*_runs_and_logs(folder))[0] == []


def grid_of_cells(folder: Path) -> Path:
    """GRPO and GSPO against VESPO at (N, lr) = (8, 4e-4), (8, 2e-4) and (16, 4e-4); GRPO also at (16, 2e-4),
    where VESPO has no run. One seed each, except GRPO at (8, 4e-4) (two)."""
    mini_log(folder, "vespo", 8, 0, lr=4e-4, score=0.50, diag=(0.40, 0.40))
    mini_log(folder, "vespo", 8, 0, lr=2e-4, score=0.30, diag=(0.20, 0.20))
    mini_log(folder, "vespo", 16, 0, lr=4e-4, score=0.40, diag=(0.60, 0.60))
    mini_log(folder, "grpo", 8, 0, lr=4e-4, score=0.60, diag=(0.10, 0.30))
    mini_log(folder, "grpo", 8, 1, lr=4e-4, score=0.70, diag=(0.20, 0.20))
    mini_log(folder, "grpo", 8, 0, lr=2e-4, score=0.25, diag=(0.50, 0.50))
    mini_log(folder, "grpo", 16, 0, lr=4e-4, score=0.40, diag=(0.70, 0.70))
    mini_log(folder, "grpo", 16, 0, lr=2e-4, score=0.90, diag=(0.10, 0.10))
    mini_log(folder, "gspo", 8, 0, lr=4e-4, score=0.45, diag=(0.35, 0.35))
    mini_log(folder, "gspo", 8, 0, lr=2e-4, score=0.35, diag=(0.05, 0.15))
    mini_log(folder, "gspo", 16, 0, lr=4e-4, score=0.10, diag=(0.80, 0.80))
    return folder


# (algorithm, N, lr, starved mass, gap in pp, seeds): by hand from grid_of_cells.
EXPECTED_POINTS = [
    ("grpo", 8, 2e-4, 0.50, -5.0, 1),  # 25 − 30
    ("grpo", 8, 4e-4, 0.20, +15.0, 2),  # mass mean(0.20, 0.20); score mean(60, 70) − 50
    ("grpo", 16, 4e-4, 0.70, 0.0, 1),
    ("gspo", 8, 2e-4, 0.10, +5.0, 1),
    ("gspo", 8, 4e-4, 0.35, -5.0, 1),
    ("gspo", 16, 4e-4, 0.80, -30.0, 1),
]


def test_gap_points_are_the_hand_computed_gaps_and_masses(tmp_path):
    points, left_out = gap_points(*_runs_and_logs(grid_of_cells(tmp_path / "logs")))
    got = [(p.algorithm, p.reuse, p.lr, p.starved_mass, p.gap_pp, p.seeds) for p in points]
    assert len(got) == len(EXPECTED_POINTS)
    for point, expected in zip(got, EXPECTED_POINTS, strict=True):
        assert point[:3] == expected[:3] and point[5] == expected[5]
        assert point[3] == pytest.approx(expected[3]) and point[4] == pytest.approx(expected[4])
    assert {p.baseline_seeds for p in points} == {1}
    # VESPO's own share in each point's cell: 0.40 at (8, 4e-4), 0.20 at (8, 2e-4), 0.60 at (16, 4e-4).
    vespo = {(8, 4e-4): 0.40, (8, 2e-4): 0.20, (16, 4e-4): 0.60}
    assert [p.baseline_starved_mass for p in points] == [pytest.approx(vespo[(p.reuse, p.lr)]) for p in points]
    assert left_out == ["grpo N=16, lr 0.0002: no VESPO run at N=16, lr 0.0002"]


def test_the_gap_plot_draws_the_points_and_the_report_lists_them(tmp_path):
    folder = grid_of_cells(tmp_path / "logs")
    points, _ = gap_points(*_runs_and_logs(folder))
    fig = gap_figure(points)
    (ax,) = fig.axes
    drawn = {}
    for collection in ax.collections:
        drawn[collection.get_label()] = [tuple(xy) for xy in collection.get_offsets()]
    assert set(drawn) == {"GRPO", "GSPO"}
    expected = {
        "GRPO": [(100 * m, gap) for a, _, _, m, gap, _ in EXPECTED_POINTS if a == "grpo"],
        "GSPO": [(100 * m, gap) for a, _, _, m, gap, _ in EXPECTED_POINTS if a == "gspo"],
    }
    for label, xy in expected.items():
        assert drawn[label] == [pytest.approx(p) for p in xy]
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted(f"N={n}, lr {lr:g}" for _, n, lr, *_ in EXPECTED_POINTS)

    text = report(folder, tmp_path / "report")
    assert (tmp_path / "report" / "gap_vs_starved_mass.png").stat().st_size > 0
    assert "- `gap_vs_starved_mass.png`: late-score gap to VESPO against the method-independent" in text
    assert "| GRPO | 8 | 0.0004 | 20.0 | +15.00 | 40.0 | 2 / 1 (VESPO) |" in text
    assert "| GSPO | 16 | 0.0004 | 80.0 | -30.00 | 60.0 | 1 / 1 (VESPO) |" in text
    assert "- grpo N=16, lr 0.0002: no VESPO run at N=16, lr 0.0002" in text
    # The (algorithm, N) groups mix learning rates and are refused; the gap plot keeps them apart and uses them.
    refused = next(line for line in text.splitlines() if line.startswith("- grpo N=8: not averaged — "))
    assert "learning rates differ (file names)" in refused


def test_without_a_vespo_run_the_gap_plot_is_one_line_and_no_file(tmp_path):
    folder = tmp_path / "logs"
    mini_log(folder, "grpo", 8, 0, score=0.6, diag=(0.2, 0.2))
    mini_log(folder, "gspo", 8, 0, score=0.5, diag=(0.1, 0.1))
    text = report(folder, tmp_path / "report")
    section = text[text.index("## Late-score gap against starved mass") :].split("\n## ")[0].strip().splitlines()
    assert section[1:] == ["", "No VESPO run was found, so there is no gap to VESPO to plot against starved mass."]
    assert not (tmp_path / "report" / "gap_vs_starved_mass.png").exists()
    assert gap_points(*_runs_and_logs(folder)) == (
        [],
        ["grpo N=8, lr 0.0004: no VESPO run at N=8, lr 0.0004", "gspo N=8, lr 0.0004: no VESPO run at N=8, lr 0.0004"],
    )


def test_every_algorithm_the_package_knows_is_read_from_the_miniature_s_names_and_reported(tmp_path):
    """The ablation presets too (``respo_pos`` must not be read as ``respo``), each with its measure and its gap."""
    folder = tmp_path / "logs"
    names = sorted(algorithms.BY_NAME)
    for i, name in enumerate(names):
        assert parse_run_name(f"{name}_n8_lr4e-04_w0_seed1").algorithm == name
        mini_log(folder, name, 8, 0, score=0.5 if name == algorithms.BASELINE else 0.25, diag=(0.01 * i, 0.01 * i))
    text = report(folder, tmp_path / "report", "--no-plots")
    for i, name in enumerate(names):
        late = "50.00" if name == algorithms.BASELINE else "25.00"
        assert f"| {algorithms.display_name(name)} | 8 | 0 | {late} | {i:.1f} | — |" in text
    points, left_out = gap_points(*_runs_and_logs(folder))
    assert left_out == []
    assert sorted(p.algorithm for p in points) == sorted(set(names) - {algorithms.BASELINE})
    assert all(p.gap_pp == pytest.approx(-25.0) for p in points)
    assert {p.algorithm: p.starved_mass for p in points} == {
        name: pytest.approx(0.01 * i) for i, name in enumerate(names) if name != algorithms.BASELINE
    }


def test_of_several_losses_own_shares_the_run_s_own_loss_is_used_and_the_choice_noted(tmp_path):
    path = mini_log(tmp_path, "respo", 8, 0, score=0.6, loss_own=0.25)
    own = '"actor/respo/starved_mass_share": 0.25'
    path.write_text(path.read_text().replace(own, own + ', "actor/a_loss/starved_mass_share": 0.5'))
    summary = summarise_run(read_log(path), None)
    assert summary.starved_mass(LOSS_OWN) == pytest.approx(0.25)
    assert summary.starved_mass(INDEPENDENT) is None
    assert summary.notes[-1] == (
        "several losses log a starved mass share (actor/respo/starved_mass_share, actor/a_loss/starved_mass_share): "
        "the loss's own measure is actor/respo/starved_mass_share's"
    )
    with pytest.raises(ValueError, match="starved mass measure 'own': choose from method-independent, loss's own"):
        summary.starved_mass("own")
