"""The shared run pieces: manifest records, log step units and the paper's windows, with hand-computed answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from respo_verl.tools.runs.logs import LogError, log_step, logged_reuse, read_log
from respo_verl.tools.runs.manifest import RunRecord, read_manifest, write_manifest
from respo_verl.tools.runs.stats import ScoreRangeError, per_update, score_curve, window_stats


def write_lines(path: Path, rows: list[tuple[int, dict]]) -> Path:
    path.write_text("".join(json.dumps({"step": step, "data": data}) + "\n" for step, data in rows))
    return path


def test_a_log_without_the_marker_counts_training_steps(tmp_path):
    log = read_log(write_lines(tmp_path / "a.jsonl", [(s, {"critic/score/mean": 0.0}) for s in (1, 2, 3)]))
    assert log_step(log) == "training"
    assert log_step(log, declared="optimizer") == "optimizer"  # the manifest may say so
    assert logged_reuse(log) is None


def test_a_per_update_log_says_so_and_is_read_per_update(tmp_path):
    rows = [(s, {"critic/score/mean": 0.0, "mini/optimizer_step": s, "mini/reuse": 4}) for s in range(1, 9)]
    log = read_log(write_lines(tmp_path / "a.jsonl", rows))
    assert log_step(log) == "optimizer"
    assert log_step(log, declared="optimizer") == "optimizer"
    assert logged_reuse(log) == 4
    with pytest.raises(LogError, match="manifest says one line per training step"):
        log_step(log, declared="training")


def test_a_marker_that_disagrees_with_the_step_is_refused(tmp_path):
    rows = [(s, {"critic/score/mean": 0.0, "mini/optimizer_step": 2 * s}) for s in (1, 2)]
    with pytest.raises(LogError, match="step unit of this log is unknown"):
        log_step(read_log(write_lines(tmp_path / "a.jsonl", rows)))


def test_per_update_expands_training_steps_only():
    assert per_update({1: 0.1, 2: 0.2}, 3, "training") == ([0.1, 0.1, 0.1, 0.2, 0.2, 0.2], [])
    assert per_update({1: 0.1, 2: 0.2}, 3, "optimizer") == ([0.1, 0.2], [])
    assert per_update({1: 0.1, 3: 0.3}, 1, "optimizer") == ([0.1, 0.3], [3])


def test_windows_are_counted_in_optimizer_updates():
    curve = [0.0] * 300 + [1.0] * 100 + [0.5] * 128  # 528 updates
    stats = window_stats(curve)
    assert stats.late == 0.5 and stats.updates == 528
    assert stats.early == 0.0  # the first 256 updates
    assert stats.auc == pytest.approx((100 + 64) / 528)
    assert window_stats([0.2, 0.4]).late == pytest.approx(0.3)  # shorter than the window: the whole run


@pytest.mark.parametrize(
    ("reward_range", "values", "match"),
    [("01", [-1.0, 1.0], "-1 at step 1 lies outside the declared reward range \\[0, 1\\]"), ("pm1", [0.5, 1.5], "1.5")],
)
def test_scores_outside_the_declared_range_are_refused(tmp_path, reward_range, values, match):
    log = read_log(write_lines(tmp_path / "a.jsonl", [(i + 1, {"critic/score/mean": v}) for i, v in enumerate(values)]))
    with pytest.raises(ScoreRangeError, match=match):
        score_curve(log, 1, "training", reward_range=reward_range)


def test_score_curve_converts_pm1_to_the_papers_score(tmp_path):
    log = read_log(
        write_lines(tmp_path / "a.jsonl", [(1, {"critic/score/mean": -1.0}), (2, {"critic/score/mean": 0.5})])
    )
    assert score_curve(log, 2, "training")[0] == [0.0, 0.0, 0.75, 0.75]
    assert score_curve(log, 2, "optimizer", reward_range="pm1")[0] == [0.0, 0.75]


def test_manifest_round_trip_and_clear_errors(tmp_path):
    record = RunRecord("m-respo-n8-s0", "respo", 8, 0, "logs/m-respo-n8-s0.jsonl", 1024, "h", log_step="training")
    path = write_manifest([record], tmp_path)
    assert read_manifest(path) == [record]
    assert record.last_log_step == 128
    with pytest.raises(ValueError, match="no such manifest file"):
        read_manifest(tmp_path / "missing.jsonl")
    bad = json.dumps({**json.loads(path.read_text()), "algorithm": "ppo"})
    (tmp_path / "bad.jsonl").write_text(bad + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: run m-respo-n8-s0: algorithm must be one of respo, vespo"):
        read_manifest(tmp_path / "bad.jsonl")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"list\.jsonl:1: not a run record"):
        read_manifest(tmp_path / "list.jsonl")


# --- logs of resumed runs --------------------------------------------------------------------------------------------


def test_a_log_that_starts_late_or_has_a_gap_is_not_complete(tmp_path):
    late = read_log(write_lines(tmp_path / "late.jsonl", [(s, {"critic/score/mean": 0.0}) for s in (3, 4, 5, 6)]))
    assert late.continuity == ["starts at step 3, not 1: steps 1-2 are missing"]
    assert not late.complete_through(6)
    gap = read_log(write_lines(tmp_path / "gap.jsonl", [(s, {"critic/score/mean": 0.0}) for s in (0, 1, 2, 5, 6)]))
    assert gap.continuity == ["gap: steps 3-4 are missing"]  # step 0 (validation before training) is no start
    assert gap.complete_through(2) and not gap.complete_through(6)


def test_a_step_repeated_by_a_resumed_attempt_is_counted_once_the_latest_kept(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", [(s, {"critic/score/mean": float(s)}) for s in (1, 2, 3)])
    with path.open("a") as fh:
        fh.write(json.dumps({"event": "resume", "attempt": 2}) + "\n")
        for s in (3, 4):
            fh.write(json.dumps({"step": s, "data": {"critic/score/mean": 10.0 * s}}) + "\n")
    log = read_log(path)
    assert log.attempts == 2 and log.steps == [1, 2, 3, 4]
    assert log.metrics["critic/score/mean"] == {1: 1.0, 2: 2.0, 3: 30.0, 4: 40.0}
    assert log.continuity == [
        "steps 3 were logged by more than one attempt (attempts [1, 2]); each is counted once, the line of attempt 2 "
        "kept"
    ]
    assert not log.skipped and log.complete_through(4)


def test_a_step_a_guard_stopped_in_is_marked_unless_a_relaunch_went_on(tmp_path):
    rows = [(1, {"critic/score/mean": 0.1}), (2, {"critic/score/mean": 0.2, "respo_verl/stopped": 1.0})]
    stopped = read_log(write_lines(tmp_path / "stopped.jsonl", rows))
    assert stopped.stopped_at == 2 and stopped.metrics["critic/score/mean"] == {1: 0.1, 2: 0.2}
    assert stopped.continuity == ["stopped by a run guard in step 2 (its line has respo_verl/stopped = 1)"]
    path = write_lines(tmp_path / "relaunched.jsonl", rows)
    with path.open("a") as fh:
        fh.write(json.dumps({"event": "resume", "attempt": 2}) + "\n")
        fh.write(json.dumps({"step": 2, "data": {"critic/score/mean": 0.25}}) + "\n")
    went_on = read_log(path)
    assert went_on.stopped_at is None and not any("stopped" in note for note in went_on.continuity)
    assert read_log(write_lines(tmp_path / "plain.jsonl", rows[:1])).stopped_at is None


def test_the_patched_file_logger_appends_after_a_resume_line_and_the_reader_agrees(tmp_path, monkeypatch):
    """verl's own FileLogger under respo-verl's version-keyed patch (respo_verl/patches/verl_0_9_1.py)."""
    from verl.utils import tracking

    from respo_verl.patches.verl_0_9_1 import FILE_LOGGER_APPEND

    original = tracking.FileLogger
    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    FILE_LOGGER_APPEND.apply()
    try:
        for attempt, steps in enumerate(((1, 2, 3), (3, 4), (5,)), start=1):
            logger = tracking.FileLogger("p", "e")  # what verl's Tracking builds for logger "file"
            for step in steps:
                logger.log({"critic/score/mean": attempt + step / 10}, step)
            logger.finish()
    finally:
        FILE_LOGGER_APPEND.remove()
    assert tracking.FileLogger is original
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line.get("event") for line in lines if "event" in line] == ["resume", "resume"]
    assert [line["attempt"] for line in lines if "event" in line] == [2, 3]
    log = read_log(path)
    assert log.attempts == 3 and log.complete_through(5)
    assert log.metrics["critic/score/mean"][3] == pytest.approx(2.3)  # attempt 2's line
    assert "the line of attempt 2 kept" in log.continuity[0]


def test_a_resume_after_a_cut_line_starts_its_own_line_and_the_reader_names_the_cut_one(tmp_path, monkeypatch):
    """An attempt killed in the middle of writing its step 3 line: the next attempt's resume line is not glued to it."""
    from verl.utils import tracking

    from respo_verl.patches.verl_0_9_1 import FILE_LOGGER_APPEND

    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    FILE_LOGGER_APPEND.apply()
    try:
        logger = tracking.FileLogger("p", "e")
        for step in (1, 2):
            logger.log({"critic/score/mean": step / 10}, step)
        logger.finish()
        with path.open("ab") as fh:
            fh.write(b'{"step": 3, "data": {"critic/sc')  # the kill
        logger = tracking.FileLogger("p", "e")
        for step in (3, 4):
            logger.log({"critic/score/mean": 1 + step / 10}, step)
        logger.finish()
    finally:
        FILE_LOGGER_APPEND.remove()
    lines = path.read_text().splitlines()
    assert lines[2] == '{"step": 3, "data": {"critic/sc' and json.loads(lines[3]) == {"event": "resume", "attempt": 2}
    log = read_log(path)
    assert log.attempts == 2 and log.complete_through(4)
    assert log.metrics["critic/score/mean"][3] == pytest.approx(1.3)
    assert len(log.skipped) == 1 and "run.jsonl:3: not JSON" in log.skipped[0], log.skipped


# --- hostile logs (issue 55): every bad line skipped with its line number, nothing crashes or fills memory ---------
HOSTILE_LINES = [
    '{"event": "resume", "attempt": "x"}',  # not an integer attempt
    '{"event": "resume", "attempt": [1]}',
    '{"step": 2, "data": {"m": ' + "9" * 5000 + "}}",  # more digits than Python reads
    "[" * 100_000 + "]" * 100_000,  # nested deeper than the JSON reader recurses
    '{"step": 1000000000000000000, "data": {"m": 1.0}}',  # a step that would list a quintillion missing ones
    '{"step": 3, "data": {"m": ' + "1" + "0" * 400 + "}}",  # an integer too large for a float
    '{"step": "4", "data": {"m": 1.0}}',
]


def test_hostile_log_lines_are_skipped_with_their_line_numbers(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(
        '{"step": 1, "data": {"m": 0.5}}\n' + "\n".join(HOSTILE_LINES) + '\n{"step": 2, "data": {"m": 1}}\n'
    )
    log = read_log(path)
    assert log.series("m") == {1: 0.5, 2: 1.0}
    assert [note.split(":", 2)[1] for note in log.skipped] == [str(n) for n in range(2, 2 + len(HOSTILE_LINES))]
    assert log.complete_through(2) and not log.complete_through(10**12)  # no loop over a trillion steps


def test_a_log_with_far_apart_steps_is_described_without_listing_them(tmp_path):
    rows = [(step, {"m": 0.0}) for step in (5, *range(10, 10_000_000, 500_000))]
    log = read_log(write_lines(tmp_path / "a.jsonl", rows))
    assert log.continuity[0] == "starts at step 5, not 1: steps 1-4 are missing"
    assert log.continuity[1].startswith("gap: steps 6-9, 11-500009, ") and "(and 10 more gaps)" in log.continuity[1]


def test_sweep_and_report_read_a_folder_of_hostile_logs_without_a_traceback(tmp_path, capsys):
    from respo_verl.cli import main as cli_main

    out = tmp_path / "out"
    argv = ["sweep", "--print", "--no-compose", "--algos", "respo", "--reuse", "1", "--seeds", "0",
            "--optimizer-steps", "2", "--model", "m", "--out", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    (record,) = read_manifest(out / "manifest.jsonl")
    log = out / record.log
    log.parent.mkdir(parents=True)
    log.write_text("\n".join(HOSTILE_LINES) + '\n{"step": 1, "data": {"critic/score/mean": 0.5}}\n')
    capsys.readouterr()
    assert cli_main(argv) == 0  # the run is not complete: printed again, not skipped
    assert not capsys.readouterr().out.startswith("# complete")
    status = cli_main(["report", str(out), "--out", str(tmp_path / "report")])
    err = capsys.readouterr().err
    assert status in (0, 2) and "Traceback" not in err, err
