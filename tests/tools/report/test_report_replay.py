"""`respo-verl report` keeps what differs apart: runs of different routing replay modes or models are never averaged
together, and routing replay is compared with its absence, on synthetic verl logs with hand-computed answers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support.report_logs import runs_and_logs, write_routing_log, write_score_log

from respo_verl.tools.report.analysis import GroupKey, replay_differences, summarise_groups
from respo_verl.tools.report.build import build_report
from respo_verl.tools.runs.manifest import RunRecord, read_manifest, write_manifest

N = 4
STEPS = 8  # training steps: 32 optimizer updates at N = 4
T_975_DF2 = 4.302653  # t(0.975, df = 2) from a t table: two seeds a side with equal variances


def half_width_pp(a: tuple[float, float], b: tuple[float, float]) -> float:
    """The 95 % Welch half width (pp) of two seeds against two seeds of equal variance (then df = 2)."""
    va, vb = (a[0] - a[1]) ** 2 / 2, (b[0] - b[1]) ** 2 / 2
    assert va == pytest.approx(vb)
    return 100 * T_975_DF2 * math.sqrt(va / 2 + vb / 2)


def name(algorithm: str, seed: int, routing: str = "off", model: str = "cpu-chain") -> str:
    """The package's run name (respo_verl.run.resolvers.run_name): no suffix without routing replay."""
    return f"{model}-{algorithm}-n{N}-s{seed}" + ("" if routing == "off" else f"-{routing}")


# The shape: ReSPO and VESPO at N = 4, seeds 0-1 without replay, seeds 2-3 with R3.
SCORES = {
    ("respo", "off"): (0.50, 0.54),
    ("respo", "r3"): (0.60, 0.64),
    ("vespo", "off"): (0.40, 0.44),
    ("vespo", "r3"): (0.45, 0.49),
}


def write_grid(folder: Path, scores=SCORES, model: str = "cpu-chain") -> list[RunRecord]:
    """The logs of ``scores`` ((algorithm, routing) -> late score per seed; R2 and R3 seeds after the off seeds),
    and the manifest records a sweep would write for them (one configuration hash per algorithm and routing)."""
    records = []
    for (algorithm, routing), lates in scores.items():
        first_seed = 0 if routing == "off" else 2
        for seed, late in enumerate(lates, start=first_seed):
            run = name(algorithm, seed, routing, model)
            write_score_log(folder / "logs" / f"{run}.jsonl", late, STEPS)
            digest = f"{model}-{algorithm}-{routing}"
            records.append(RunRecord(run, algorithm, N, seed, f"logs/{run}.jsonl", STEPS * N, digest, routing=routing))
    return records


def report(folder: Path) -> str:
    return build_report([folder], out=folder / "report", plots=False)[0]


def section(text: str, title: str) -> str:
    head = f"## {title}\n"
    assert head in text, f"no section {title!r}"
    body = text[text.index(head) + len(head) :]
    return body[: body.index("\n## ")] if "\n## " in body else body


def test_r3_and_off_logs_without_a_manifest_are_two_groups_per_method_and_a_replay_row_each(tmp_path):
    """The issue's repro: without a manifest the four seeds of each method were averaged as one group."""
    write_grid(tmp_path)
    groups, refused = summarise_groups(*runs_and_logs(tmp_path / "logs"))
    assert refused == []
    assert {g.key: [r.seed for r in g.runs] for g in groups} == {
        GroupKey("respo", N, "cpu-chain", "off"): [0, 1],
        GroupKey("respo", N, "cpu-chain", "r3"): [2, 3],
        GroupKey("vespo", N, "cpu-chain", "off"): [0, 1],
        GroupKey("vespo", N, "cpu-chain", "r3"): [2, 3],
    }
    text = report(tmp_path / "logs")
    late = section(text, "Late training score (%)")
    assert "| method | routing | N = 4 |" in late
    # ReSPO against VESPO within each routing mode: 52 − 42 = +10 pp off, 62 − 47 = +15 pp with R3.
    half = half_width_pp(SCORES[("respo", "off")], SCORES[("vespo", "off")])
    assert f"| ReSPO | off | 52.00 ± 2.83 (n=2)<br>+10.00 pp [{10 - half:+.2f}, {10 + half:+.2f}] |" in late
    assert "| ReSPO | R3 | 62.00 ± 2.83 (n=2)<br>+15.00 pp" in late
    assert "| VESPO | off | 42.00 ± 2.83 (n=2) |" in late and "| VESPO | R3 | 47.00 ± 2.83 (n=2) |" in late
    assert "(n=4)" not in text
    # The replay table: R3 − off per method, ReSPO +10 pp, VESPO +5 pp, with the method table's interval.
    replay = section(text, "Routing replay")
    assert "| method | N | replay | late, off (%) | late, replay (%) | replay − off |" in replay
    half = half_width_pp(SCORES[("respo", "r3")], SCORES[("respo", "off")])
    assert (
        f"| ReSPO | 4 | R3 | 52.00 ± 2.83 (n=2) | 62.00 ± 2.83 (n=2) | +10.00 pp [{10 - half:+.2f}, {10 + half:+.2f}] |"
        in replay
    )
    half = half_width_pp(SCORES[("vespo", "r3")], SCORES[("vespo", "off")])
    assert f"| VESPO | 4 | R3 | 42.00 ± 2.83 (n=2) | 47.00 ± 2.83 (n=2) | +5.00 pp [{5 - half:+.2f}," in replay
    assert "Not compared" not in replay
    details = section(text, "Details")
    assert "| ReSPO | off | 4 | 0,1 | 52.00 |" in details and "| ReSPO | R3 | 4 | 2,3 | 62.00 |" in details


def test_a_manifest_of_r3_and_off_runs_is_reported_side_by_side_not_refused(tmp_path):
    """A sweep's R3 and off runs have different configuration hashes: once refused as mixed, now two groups."""
    write_manifest(write_grid(tmp_path), tmp_path)
    text = report(tmp_path)
    assert "not averaged" not in text and "What was not used" not in text
    assert "| ReSPO | 4 | R3 | 52.00 ± 2.83 (n=2) | 62.00 ± 2.83 (n=2) | +10.00 pp" in section(text, "Routing replay")


def test_a_manifest_still_refuses_two_configurations_within_one_replay_mode(tmp_path):
    records = write_grid(tmp_path)
    odd = next(r for r in records if (r.algorithm, r.routing, r.seed) == ("respo", "r3", 3))
    odd.config_hash = "another"
    write_manifest(records, tmp_path)
    text = report(tmp_path)
    not_used = section(text, "What was not used")
    assert "- respo N=4 (R3): not averaged — different configurations (manifest config_hash)" in not_used
    assert "respo N=4 (off): not averaged" not in not_used
    replay = section(text, "Routing replay")
    assert "| ReSPO | 4 | R3 |" not in replay and "| VESPO | 4 | R3 |" in replay
    assert "- respo N=4 (R3): its runs are not averaged" in replay


def test_r2_and_r3_each_against_off_and_a_replay_mode_without_off_runs_is_named(tmp_path):
    scores = {
        ("respo", "off"): (0.50, 0.54),
        ("respo", "r2"): (0.55, 0.59),
        ("respo", "r3"): (0.60, 0.64),
        ("grpo", "r2"): (0.30, 0.34),  # no GRPO run without replay
    }
    write_grid(tmp_path, scores)
    text = report(tmp_path / "logs")
    replay = section(text, "Routing replay")
    rows = [line for line in replay.splitlines() if line.startswith("| ReSPO |")]
    assert [row.split(" | ")[2] for row in rows] == ["R2", "R3"]  # R2 before R3
    assert "| ReSPO | 4 | R2 | 52.00 ± 2.83 (n=2) | 57.00 ± 2.83 (n=2) | +5.00 pp" in replay
    assert "| ReSPO | 4 | R3 | 52.00 ± 2.83 (n=2) | 62.00 ± 2.83 (n=2) | +10.00 pp" in replay
    assert "- grpo N=4 (R2): no run without routing replay of the same model, algorithm and N" in replay
    assert "| GRPO | R2 | 32.00 ± 2.83 (n=2) |" in section(text, "Late training score (%)")


def test_models_are_never_averaged_together_and_replay_is_compared_within_a_model(tmp_path):
    write_grid(tmp_path, {("respo", "off"): (0.50, 0.54), ("respo", "r3"): (0.60, 0.64)}, model="small")
    write_grid(tmp_path, {("respo", "off"): (0.20, 0.24)}, model="large")
    groups, _ = summarise_groups(*runs_and_logs(tmp_path / "logs"))
    assert sorted((g.model, g.routing, len(g.runs)) for g in groups) == [
        ("large", "off", 2),
        ("small", "off", 2),
        ("small", "r3", 2),
    ]
    differences, left_out = replay_differences(groups, runs_and_logs(tmp_path / "logs")[0])
    assert [(d.replay.model, d.off.model, d.off.late_mean) for d in differences] == [
        ("small", "small", pytest.approx(0.52))
    ]
    assert left_out == []
    text = report(tmp_path / "logs")
    late = section(text, "Late training score (%)")
    assert "| method | model | routing | N = 4 |" in late
    assert "| ReSPO | large | off | 22.00 ± 2.83 (n=2) |" in late and "| ReSPO | small | R3 | 62.00" in late
    assert "Runs of different models or routing replay modes are never averaged together" in late
    assert "| ReSPO | small | 4 | R3 | 52.00 ± 2.83 (n=2) | 62.00 ± 2.83 (n=2) | +10.00 pp" in section(
        text, "Routing replay"
    )


def test_one_model_without_replay_reports_as_before(tmp_path):
    write_grid(tmp_path, {k: v for k, v in SCORES.items() if k[1] == "off"})
    text = report(tmp_path / "logs")
    assert "| method | N = 4 |" in text and "| ReSPO | 52.00 ± 2.83 (n=2)<br>+10.00 pp" in text
    assert "## Routing replay" not in text and "routing" not in section(text, "Details").splitlines()[4]
    assert "never averaged together" not in text


def test_the_manifest_s_routing_is_used_and_the_name_s_when_the_manifest_has_none(tmp_path):
    """The miniature records no routing and names an R2 run ``..._r2``; a sweep records it."""
    records = []

    def run(stem: str, algorithm: str, seed: int, late: float, routing: str | None = None) -> None:
        write_score_log(tmp_path / "logs" / f"{stem}.jsonl", late, STEPS)
        records.append(RunRecord(stem, algorithm, N, seed, f"logs/{stem}.jsonl", STEPS * N, "h", routing=routing))

    for seed, late in ((0, 0.50), (1, 0.54)):
        run(f"respo_n{N}_lr4e-04_w0_seed{seed}", "respo", seed, late)
        run(f"respo_n{N}_lr4e-04_w0_seed{seed}_r2", "respo", seed, late + 0.1)
        run(f"custom-vespo-run-{seed}", "vespo", seed, late, routing="r3")  # a name that says no routing
    write_manifest(records, tmp_path)
    text = report(tmp_path)
    assert "| ReSPO | 4 | R2 | 52.00 ± 2.83 (n=2) | 62.00 ± 2.83 (n=2) | +10.00 pp" in section(text, "Routing replay")
    assert "| VESPO | R3 | 4 | 0,1 | 52.00 |" in section(text, "Details")
    assert "- vespo N=4 (R3): no run without routing replay of the same model, algorithm and N" in text


def test_a_manifest_whose_routing_contradicts_its_run_name_leaves_the_run_out(tmp_path):
    records = write_grid(tmp_path, {("respo", "off"): (0.50, 0.54), ("respo", "r3"): (0.60, 0.64)})
    wrong = next(r for r in records if r.routing == "r3" and r.seed == 2)
    wrong.routing = "r2"
    write_manifest(records, tmp_path)
    text = report(tmp_path)
    assert f"the manifest says routing r2, its run name '{wrong.name}' says r3" in section(text, "What was not used")
    assert "| ReSPO | R3 | 64.00 (n=1) |" in section(text, "Late training score (%)")  # seed 3 alone


def test_a_manifest_routing_outside_the_replay_modes_is_refused_with_its_line(tmp_path):
    (tmp_path / "manifest.jsonl").write_text(
        '{"name": "m-respo-n4-s0", "algorithm": "respo", "reuse": 4, "seed": 0, "log": "x.jsonl", '
        '"optimizer_steps": 32, "config_hash": "h", "routing": "R3"}\n'
    )
    with pytest.raises(ValueError, match=r"manifest.jsonl:1: run m-respo-n4-s0: routing must be one of off, r2, r3"):
        read_manifest(tmp_path / "manifest.jsonl")


def test_route_drift_of_r2_and_r3_runs_is_not_averaged_together(tmp_path):
    """Two R2 seeds flip j / 100 at update j, two R3 seeds 1 % everywhere: one row each."""
    folder = tmp_path / "logs"
    for seed in (0, 1):
        write_routing_log(folder / f"{name('respo', seed, 'r2')}.jsonl", N, STEPS, lambda s, j: j / 100)
        write_routing_log(folder / f"{name('respo', seed + 2, 'r3')}.jsonl", N, STEPS, lambda s, j: 0.01)
    drift = section(report(folder), "Route drift")
    assert "| method | routing | N | seeds | late steps | flip, j = 0 | flip, last j | last j |" in drift
    assert "| ReSPO | R2 | 4 | 0,1 | 8,8 | 0.00 | 3.00 | 3 | 1.50 |" in drift
    assert "| ReSPO | R3 | 4 | 2,3 | 8,8 | 1.00 | 1.00 | 3 | 1.00 |" in drift
