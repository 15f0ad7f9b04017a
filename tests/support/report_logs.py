"""Report test helper: the run summaries and parsed logs of a folder of file-logger logs, as the report reads them."""

from __future__ import annotations

from pathlib import Path

from respo_verl.tools.report.analysis import summarise_run
from respo_verl.tools.runs.logs import read_log


def runs_and_logs(folder: Path):
    """``(runs, logs)``: each ``*.jsonl`` of ``folder`` summarised (no manifest), and its log by run name."""
    runs, logs = [], {}
    for path in sorted(Path(folder).glob("*.jsonl")):
        log = read_log(path)
        summary = summarise_run(log, None)
        runs.append(summary)
        logs[summary.name] = log
    return runs, logs
