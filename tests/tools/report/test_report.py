"""`respo-verl report` on synthetic verl file-logger logs with hand-computed answers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from respo_verl.cli import main as cli_main
from respo_verl.tools.report.analysis import summarise_run, welch_interval
from respo_verl.tools.runs.logs import read_log
from respo_verl.tools.runs.manifest import RunRecord, write_manifest

N = 8
TRAINING_STEPS = 128  # 1024 optimizer steps at N = 8
LATE_TRAINING_STEPS = 128 // N  # the late window: the last 16 training steps


def write_log(path: Path, late_score: float, steps: int = TRAINING_STEPS, lr: float = 1e-6, extra_lines=()) -> Path:
    """Reward −1 before the late window, then the reward whose (r+1)/2 is ``late_score``; one line per step."""
    late_reward = 2 * late_score - 1
    lines = []
    for step in range(1, steps + 1):
        reward = late_reward if step > steps - LATE_TRAINING_STEPS else -1.0
        data = {"critic/score/mean": reward, "response_length/mean": 100.0 + step, "actor/lr": lr}
        lines.append(json.dumps({"step": step, "data": data}))
    path.write_text("\n".join([*lines, *extra_lines]) + "\n")
    return path


def grid(tmp_path: Path, lates: dict[str, list[float]], hashes=None, lrs=None) -> Path:
    records = []
    for algorithm, values in lates.items():
        for seed, late in enumerate(values):
            name = f"m-{algorithm}-n{N}-s{seed}"
            lr = (lrs or {}).get((algorithm, seed), 1e-6)
            write_log(tmp_path / "logs" / f"{name}.jsonl", late, lr=lr)
            digest = (hashes or {}).get((algorithm, seed), f"hash-{algorithm}")
            records.append(RunRecord(name, algorithm, N, seed, f"logs/{name}.jsonl", 1024, digest))
    write_manifest(records, tmp_path)
    return tmp_path


@pytest.fixture
def logs_dir(tmp_path):
    (tmp_path / "logs").mkdir()
    return tmp_path


def test_late_early_and_auc_of_one_run(logs_dir):
    path = write_log(logs_dir / "logs" / "m-respo-n8-s0.jsonl", late_score=0.75)
    summary = summarise_run(read_log(path), None)
    assert (summary.algorithm, summary.reuse, summary.seed) == ("respo", 8, 0)
    assert len(summary.curve) == 1024
    assert summary.late == pytest.approx(0.75)
    assert summary.early == pytest.approx(0.0)  # reward −1 throughout the first 256 optimizer steps
    assert summary.auc == pytest.approx(0.75 * 128 / 1024)
    assert summary.length == pytest.approx(100 + (1 + 128) / 2)


def test_welch_interval_with_equal_variances_uses_four_degrees_of_freedom():
    low, high = welch_interval([0.60, 0.62, 0.64], [0.50, 0.52, 0.54])
    half = 2.776445 * math.sqrt(2 * 0.0004 / 3)  # t(0.975, df = 4) from a t table
    assert (low, high) == (pytest.approx(0.10 - half, abs=1e-6), pytest.approx(0.10 + half, abs=1e-6))
    assert welch_interval([0.5], [0.4, 0.6]) is None


def test_report_table_with_known_answers(logs_dir, capsys):
    grid(logs_dir, {"respo": [0.60, 0.62, 0.64], "vespo": [0.50, 0.52, 0.54], "grpo": [0.40, 0.40, 0.40]})
    out = logs_dir / "report"
    assert cli_main(["report", str(logs_dir), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    half = 100 * 2.776445 * math.sqrt(2 * 0.0004 / 3)
    assert f"| ReSPO | 62.00 ± 2.00 (n=3)<br>+10.00 pp [{10 - half:+.2f}, {10 + half:+.2f}] |" in text
    assert "| VESPO | 52.00 ± 2.00 (n=3) |" in text
    assert "| GRPO | 40.00 ± 0.00 (n=3)<br>-12.00 pp" in text
    assert (out / "score_n8.png").stat().st_size > 0
    assert "written:" in capsys.readouterr().out


def test_corrupt_and_truncated_lines_are_skipped_and_reported(logs_dir):
    path = write_log(logs_dir / "logs" / "m-respo-n8-s0.jsonl", 0.6, extra_lines=['{"step": 129, "data": {"critic/s'])
    text = path.read_text().splitlines()
    text.insert(5, "garbage that is not json")
    text.insert(9, json.dumps({"step": 7, "data": {"critic/values/mean": None}}))
    path.write_text("\n".join(text))  # no trailing newline: the truncated line is the last one
    log = read_log(path)
    assert log.last_step == TRAINING_STEPS
    reasons = " | ".join(log.skipped)
    assert "truncated last line" in reasons and "not JSON" in reasons and "critic/values/mean is null" in reasons
    assert summarise_run(log, None).late == pytest.approx(0.6)


def test_unequal_lengths_are_summarised_and_flagged(logs_dir):
    grid(logs_dir, {"respo": [0.6, 0.6], "vespo": [0.5, 0.5]})
    write_log(logs_dir / "logs" / "m-respo-n8-s1.jsonl", late_score=0.7, steps=64)  # stopped half-way
    out = logs_dir / "report"
    assert cli_main(["report", str(logs_dir), "--out", str(out), "--no-plots"]) == 0
    text = (out / "report.md").read_text()
    assert "m-respo-n8-s1: incomplete: 64 of 128 training steps logged" in text
    # the tables say which run is partial: the cell counts it, the seeds column names it, the legend says what it is
    assert "| ReSPO | 65.00 ± 7.07 (n=2, 1 partial)" in text and "| VESPO | 50.00 ± 0.00 (n=2) |" in text
    assert "| ReSPO | 8 | 0,1 (partial: 1) |" in text and "| VESPO | 8 | 0,1 |" in text
    assert "Partial (m-respo-n8-s1): the log ends before the run's planned last step" in text


def test_mixed_configurations_are_not_averaged(logs_dir):
    grid(logs_dir, {"respo": [0.6, 0.6, 0.6], "vespo": [0.5, 0.5]}, hashes={("respo", 2): "other"})
    out = logs_dir / "report"
    assert cli_main(["report", str(logs_dir), "--out", str(out), "--no-plots"]) == 0
    text = (out / "report.md").read_text()
    assert "respo N=8: not averaged — different configurations" in text
    assert "| ReSPO |" not in text


def test_different_learning_rates_without_manifest_are_not_averaged(logs_dir):
    write_log(logs_dir / "logs" / "m-vespo-n8-s0.jsonl", 0.5, lr=1e-6)
    write_log(logs_dir / "logs" / "m-vespo-n8-s1.jsonl", 0.5, lr=2e-6)
    out = logs_dir / "report"
    assert cli_main(["report", str(logs_dir / "logs"), "--out", str(out), "--no-plots"]) == 0
    assert "vespo N=8: not averaged — actor/lr differs at step 1" in (out / "report.md").read_text()


def test_unknown_metric_is_reported_with_suggestions(logs_dir, capsys):
    grid(logs_dir, {"respo": [0.6]})
    assert cli_main(["report", str(logs_dir), "--metric", "response_length/meen", "--out", str(logs_dir / "r")]) == 2
    err = capsys.readouterr().err
    assert "'response_length/meen' is not in any of the logs" in err and "response_length/mean" in err


def test_empty_or_corrupt_logs_only(logs_dir, capsys):
    (logs_dir / "logs" / "m-respo-n8-s0.jsonl").write_text("")
    (logs_dir / "logs" / "m-respo-n8-s1.jsonl").write_text("not json\n")
    assert cli_main(["report", str(logs_dir), "--out", str(logs_dir / "r")]) == 2
    assert "no log holds a usable metric line" in capsys.readouterr().err


def test_log_without_manifest_or_parsable_name_is_left_out(logs_dir):
    grid(logs_dir, {"respo": [0.6], "vespo": [0.5]})
    write_log(logs_dir / "stray.jsonl", 0.9)
    out = logs_dir / "report"
    assert cli_main(["report", str(logs_dir), "--out", str(out), "--no-plots"]) == 0
    assert "stray.jsonl: no manifest entry" in (out / "report.md").read_text()


def test_a_log_truncated_by_a_resume_and_one_with_a_repeated_step_are_flagged(logs_dir):
    grid(logs_dir, {"respo": [0.6, 0.6], "vespo": [0.5, 0.5]})
    truncated = logs_dir / "logs" / "m-respo-n8-s0.jsonl"
    truncated.write_text("\n".join(truncated.read_text().splitlines()[2:]) + "\n")  # steps 3..128 only
    repeated = logs_dir / "logs" / "m-respo-n8-s1.jsonl"
    lines = repeated.read_text().splitlines()
    resume = [json.dumps({"event": "resume", "attempt": 2}), *lines[40:42]]  # steps 41, 42 again
    repeated.write_text("\n".join([*lines[:42], *resume, *lines[42:]]) + "\n")
    out = logs_dir / "report"
    assert cli_main(["report", str(logs_dir), "--out", str(out), "--no-plots"]) == 0
    text = (out / "report.md").read_text()
    assert "m-respo-n8-s0: log: starts at step 3, not 1: steps 1-2 are missing" in text
    assert "m-respo-n8-s0: incomplete: 126 of 128 training steps logged" in text
    assert "m-respo-n8-s1: log: steps 41-42 were logged by more than one attempt (attempts [1, 2])" in text
    assert "m-respo-n8-s1: incomplete" not in text


def test_a_run_a_guard_stopped_is_marked_in_the_report(logs_dir):
    grid(logs_dir, {"respo": [0.6, 0.6], "vespo": [0.5, 0.5]})
    log = logs_dir / "logs" / "m-respo-n8-s0.jsonl"
    lines = log.read_text().splitlines()[:30]
    last = json.loads(lines[-1])
    last["data"]["respo_verl/stopped"] = 1.0
    log.write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    out = logs_dir / "report"
    assert cli_main(["report", str(logs_dir), "--out", str(out), "--no-plots"]) == 0
    text = (out / "report.md").read_text()
    assert "m-respo-n8-s0: log: stopped by a run guard in step 30 (its line has respo_verl/stopped = 1)" in text
    assert "m-respo-n8-s1: log: stopped" not in text


def test_a_run_a_guard_warned_in_is_marked_in_the_report(logs_dir):
    """A guard set to warn counts its warnings in the log (respo_verl/guard_warnings/<guard>, and their sum)."""
    grid(logs_dir, {"respo": [0.6, 0.6], "vespo": [0.5, 0.5]})
    log = logs_dir / "logs" / "m-respo-n8-s1.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for record in records:
        if record["step"] >= 3:
            warned = {"sampler_agreement": record["step"] - 2, "routing_replay": 1}
            record["data"] |= {f"respo_verl/guard_warnings/{g}": float(n) for g, n in warned.items()}
            record["data"]["respo_verl/guard_warnings"] = float(sum(warned.values()))
    log.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert read_log(log).warnings == {"sampler_agreement": len(records) - 2, "routing_replay": 1}
    out = logs_dir / "report"
    assert cli_main(["report", str(logs_dir), "--out", str(out), "--no-plots"]) == 0
    text = (out / "report.md").read_text()
    assert (
        f"m-respo-n8-s1: log: a run guard set to warn warned from step 3 on (routing_replay 1, sampler_agreement "
        f"{len(records) - 2} warnings)" in text
    )
    assert "m-respo-n8-s0: log: a run guard" not in text


def _section(text: str, title: str) -> str:
    """The body of the report's section ``## <title>`` ('' when there is none)."""
    head = f"## {title}\n"
    if head not in text:
        return ""
    body = text[text.index(head) + len(head) :]
    return body[: body.index("\n## ")] if "\n## " in body else body


def test_a_run_that_is_used_is_not_listed_under_what_was_not_used(logs_dir):
    """A short run is averaged (its note is a caveat on a number in the table), a stray log is left out."""
    grid(logs_dir, {"respo": [0.6, 0.6], "vespo": [0.5, 0.5]})
    write_log(logs_dir / "logs" / "m-respo-n8-s1.jsonl", late_score=0.7, steps=64)
    write_log(logs_dir / "stray.jsonl", 0.9)
    out = logs_dir / "report"
    assert cli_main(["report", str(logs_dir), "--out", str(out), "--no-plots"]) == 0
    text = (out / "report.md").read_text()
    assert "| ReSPO | 65.00 ± 7.07 (n=2, 1 partial)" in text  # m-respo-n8-s1 is used
    not_used = _section(text, "What was not used")
    assert "m-respo-n8-s1" not in not_used and "stray.jsonl: no manifest entry" in not_used
    assert "- m-respo-n8-s1: incomplete: 64 of 128 training steps logged" in _section(text, "Notes on the runs used")


def test_the_difference_to_vespo_is_promised_only_where_there_is_a_vespo_run(logs_dir):
    out = logs_dir / "report"
    grid(logs_dir, {"respo": [0.60, 0.62], "grpo": [0.40, 0.42]})
    assert cli_main(["report", str(logs_dir), "--out", str(out), "--no-plots"]) == 0
    text = (out / "report.md").read_text()
    assert "second line: difference to VESPO" not in text and " pp" not in text
    assert "no VESPO run was found, so no difference to VESPO is shown." in text

    grid(logs_dir, {"respo": [0.60, 0.62], "vespo": [0.50, 0.52]})
    assert cli_main(["report", str(logs_dir), "--out", str(out), "--no-plots"]) == 0
    text = (out / "report.md").read_text()
    assert "second line: difference to VESPO at the same N in percentage points with a 95% Welch t interval." in text
    assert "no VESPO run was found" not in text


def test_the_difference_to_vespo_names_the_n_without_a_vespo_group(logs_dir):
    write_log(logs_dir / "logs" / "m-respo-n8-s0.jsonl", 0.6)
    write_log(logs_dir / "logs" / "m-vespo-n8-s0.jsonl", 0.5)
    write_log(logs_dir / "logs" / "m-respo-n16-s0.jsonl", 0.6, steps=64)
    out = logs_dir / "report"
    assert cli_main(["report", str(logs_dir / "logs"), "--out", str(out), "--no-plots"]) == 0
    text = (out / "report.md").read_text()
    assert "Welch t interval (no VESPO group at N = 16: no difference there)." in text
