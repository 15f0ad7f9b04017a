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


def write_routing_log(path: Path, reuse: int, steps: int, flip, per_update_lines: bool = False) -> Path:
    """A log with route-drift metrics whose flip share at (step, j) is ``flip(step, j)``.

    verl's form (one line per training step): ``actor/routing/by_update/j<j>/...`` for j < ``reuse`` and the step's
    mean over them under ``actor/routing/...``, as the route-drift engine and the trainer log them. With
    ``per_update_lines``, the miniature's form: one line per optimizer update, ``mini/optimizer_step`` = step, and
    that update's ``actor/routing/...``. Overlap is 1 − flip / 2 (top-2, one expert changed per flip), the any-layer
    flip share twice the flip share.
    """
    import json

    def drift(value: float) -> dict[str, float]:
        return {"flip_frac": value, "overlap": 1 - value / 2, "any_layer_flip_frac": 2 * value}

    lines = []
    if per_update_lines:
        for step in range(1, steps + 1):
            data = {"critic/score/mean": 0.0, "mini/optimizer_step": step, "mini/reuse": reuse}
            data |= {f"actor/routing/{k}": v for k, v in drift(flip(step, (step - 1) % reuse)).items()}
            lines.append(json.dumps({"step": step, "data": data}))
    else:
        for step in range(1, steps + 1):
            data = {"critic/score/mean": 0.0}
            per_j = [drift(flip(step, j)) for j in range(reuse)]
            for j, values in enumerate(per_j):
                data |= {f"actor/routing/by_update/j{j}/{k}": v for k, v in values.items()}
            data |= {f"actor/routing/{k}": sum(v[k] for v in per_j) / reuse for k in per_j[0]}
            lines.append(json.dumps({"step": step, "data": data}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def write_score_log(path: Path, score: float, steps: int = 8, lr: float = 1e-6) -> Path:
    """A verl log (one line per training step) whose score (reward + 1) / 2 is ``score`` at every step, with the
    learning rate ``lr`` that verl logs as ``actor/lr``."""
    import json

    lines = [
        json.dumps({"step": s, "data": {"critic/score/mean": 2 * score - 1, "actor/lr": lr}})
        for s in range(1, steps + 1)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
