"""`respo-verl report`'s route-drift section and figure on synthetic logs with hand-computed answers."""

from __future__ import annotations

import json

import pytest
from support.report_logs import write_routing_log

from respo_verl.tools.report.build import build_report
from respo_verl.tools.report.render import routing_figure
from respo_verl.tools.report.routing import ROUTING_PLOT, group_routing, run_routing
from respo_verl.tools.runs.logs import read_log

HEADER = "| method | N | seeds | late steps | flip, j = 0 | flip, last j | last j |"


def _row(text: str, method: str, reuse: int) -> list[str]:
    rows = [line for line in text.splitlines() if line.startswith(f"| {method} | {reuse} |")]
    rows = [r for r in rows if r.count("|") == 12]  # the route-drift table's rows (11 columns)
    assert len(rows) == 1, rows
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def _report(folder, tmp_path):
    text, outputs = build_report([folder], out=tmp_path / "report")
    return text, [p.name for p in outputs]


def test_flip_share_at_the_first_and_last_j_late_in_the_run(tmp_path):
    """N = 32: the late window (128 updates) is the last 4 steps of 6. Early steps flip 90 % everywhere; late ones
    flip j / 1000 at update j (R2: 0 on the first mini-batch, growing with staleness)."""
    folder = tmp_path / "logs"

    def flip(step, j):
        return 0.9 if step <= 2 else j / 1000

    write_routing_log(folder / "m-respo-n32-s0.jsonl", 32, 6, flip)
    write_routing_log(folder / "m-respo-n32-s1.jsonl", 32, 6, lambda s, j: 2 * flip(s, j))
    write_routing_log(folder / "m-vespo-n4-s0.jsonl", 4, 3, lambda s, j: j / 100)
    text, outputs = _report(folder, tmp_path)
    assert "## Route drift" in text and HEADER in text
    # seeds 0 and 1: 3.1 % and 6.2 % at j = 31, mean 4.65 %; all j: mean over j of j / 1000 = 1.55 %, ×1.5 over seeds
    respo = _row(text, "ReSPO", 32)
    assert respo == ["ReSPO", "32", "0,1", "4,4", "0.00", "4.65", "31", "2.33", "0.9884", "9.30", "4.65"]
    # N = 4, 3 steps: the late window (32 steps) is the whole run
    vespo = _row(text, "VESPO", 4)
    assert vespo == ["VESPO", "4", "0", "3", "0.00", "3.00", "3", "1.50", "0.9925", "6.00", "3.00"]
    assert ROUTING_PLOT in outputs and (tmp_path / "report" / ROUTING_PLOT).stat().st_size > 0
    assert "No routing metrics in" not in text


def test_runs_without_routing_metrics_are_named_and_a_report_without_any_says_so(tmp_path):
    folder = tmp_path / "logs"
    write_routing_log(folder / "m-respo-n4-s0.jsonl", 4, 2, lambda s, j: j / 100)
    lines = [json.dumps({"step": s, "data": {"critic/score/mean": 0.0}}) for s in (1, 2)]
    (folder / "m-vespo-n4-s0.jsonl").write_text("\n".join(lines) + "\n")
    text, outputs = _report(folder, tmp_path)
    assert "No routing metrics in: m-vespo-n4-s0." in text
    assert _row(text, "ReSPO", 4)[4:7] == ["0.00", "3.00", "3"]
    (folder / "m-respo-n4-s0.jsonl").unlink()
    text, outputs = _report(folder, tmp_path)
    assert "No run logged routing metrics (`actor/routing/...`: routing replay off)." in text
    assert ROUTING_PLOT not in outputs


def test_the_miniatures_per_update_lines_give_j_from_the_step(tmp_path):
    """One line per optimizer update: update j of each rollout batch is step (k·N + j + 1)."""
    path = write_routing_log(tmp_path / "respo_n4_seed0.jsonl", 4, 12, lambda s, j: j / 100, per_update_lines=True)
    drift = run_routing("r", "respo", 4, 0, "optimizer", read_log(path))
    assert drift.by_update["flip_frac"] == {(j, j): pytest.approx(j / 100) for j in range(4)}
    assert drift.overall["flip_frac"] == pytest.approx(0.015) and drift.late_steps == 12


def test_an_aggregate_only_log_has_a_row_without_per_update_values(tmp_path):
    """A log from before the per-update keys: the step means are tabulated, the j columns are empty."""
    lines = [
        json.dumps({"step": s, "data": {"critic/score/mean": 0.0, "actor/routing/flip_frac": 0.02}}) for s in (1, 2)
    ]
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "m-respo-n4-s0.jsonl").write_text("\n".join(lines) + "\n")
    text, outputs = _report(folder, tmp_path)
    assert _row(text, "ReSPO", 4)[4:8] == ["—", "—", "—", "2.00"]
    assert "No per-update values (logs from before `by_update` keys): ReSPO N=4." in text
    assert ROUTING_PLOT not in outputs


def test_the_figure_has_one_panel_per_method_and_one_line_per_n(tmp_path):
    logs = {
        ("respo", 4): lambda s, j: j / 100,
        ("respo", 8): lambda s, j: j / 200,
        ("vespo", 8): lambda s, j: j / 300,
    }
    runs = []
    for (algorithm, reuse), flip in logs.items():
        path = write_routing_log(tmp_path / f"{algorithm}-n{reuse}-s0.jsonl", reuse, 2, flip)
        runs.append(run_routing(path.stem, algorithm, reuse, 0, "training", read_log(path)))
    fig = routing_figure(group_routing(runs))
    respo_ax, vespo_ax = fig.axes
    assert respo_ax.get_title() == "ReSPO" and vespo_ax.get_title() == "VESPO"
    lines = {line.get_label(): line for line in respo_ax.get_lines()}
    assert sorted(lines) == ["N = 4 (1 seed)", "N = 8 (1 seed)"]
    assert list(lines["N = 8 (1 seed)"].get_xdata()) == list(range(8))
    assert list(lines["N = 8 (1 seed)"].get_ydata()) == pytest.approx([100 * j / 200 for j in range(8)])
    assert [line.get_label() for line in vespo_ax.get_lines()] == ["N = 8 (1 seed)"]
    import matplotlib.pyplot as plt

    plt.close(fig)
