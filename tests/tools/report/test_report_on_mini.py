"""`respo-verl report` reads a real miniature run (`python -m experiments.mini`: its logs and manifest) as it reads
a sweep, and the miniature's own table is that report: one definition of the scores
(late = last 128 optimizer updates)."""

from __future__ import annotations

import json
import statistics

from experiments.mini.cli import main as mini
from respo_verl.cli import main
from respo_verl.tools.runs.manifest import read_manifest


def test_report_of_a_mini_smoke_run(tmp_path, capsys):
    out = tmp_path / "mini"
    argv = ["--algos", "vespo,respo", "--reuse", "2", "--seeds", "0,1", "--optimizer-steps", "6"]
    argv += ["--minibatch-prompts", "1", "--group-size", "4", "--warm-start-steps", "3", "--no-progress"]
    argv += ["--workers", "1"]
    assert mini([*argv, "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 0
    records = read_manifest(out / "manifest.jsonl")
    assert sorted((r.algorithm, r.seed) for r in records) == [("respo", 0), ("respo", 1), ("vespo", 0), ("vespo", 1)]
    assert {r.log_step for r in records} == {"optimizer"} and {r.source for r in records} == {"mini"}
    # Seeds of one setting share the configuration hash, the two algorithms do not.
    assert len({r.config_hash for r in records}) == 2
    capsys.readouterr()

    report_dir = tmp_path / "report"
    assert main(["report", str(out), "--out", str(report_dir)]) == 0
    text = (report_dir / "report.md").read_text()
    # The run is shorter than the late window (128 optimizer steps): the late score is the mean over all six
    # updates of (reward + 1) / 2, which the mini log also carries as mini/score.
    for algorithm in ("respo", "vespo"):
        lates = []
        for record in (r for r in records if r.algorithm == algorithm):
            lines = [json.loads(line) for line in (out / record.log).read_text().splitlines()]
            assert [line["step"] for line in lines] == list(range(1, 7))
            lates.append(statistics.fmean(line["data"]["mini/score"] for line in lines))
        mean, std = statistics.fmean(lates), statistics.stdev(lates)
        display = {"respo": "ReSPO", "vespo": "VESPO"}[algorithm]
        assert f"| {display} | {100 * mean:.2f} ± {100 * std:.2f} (n=2)" in text
    assert "only 6 optimizer steps" in text
    assert "incomplete" not in text
    # The miniature printed and saved the same late-score table `respo-verl report` writes.
    table = text[text.index("## Late training score") : text.index("## Details")]
    assert table in (out / "results.md").read_text()
    assert table in (out / "report" / "all" / "report.md").read_text()
    assert (report_dir / "score_n2.png").exists() and (report_dir / "starved_mass_share.png").exists()
