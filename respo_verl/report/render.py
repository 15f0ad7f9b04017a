"""Markdown tables in the paper's layout and PNG plots of a comparison."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from respo_verl.report.analysis import BASELINE, CONFIDENCE, EARLY_WINDOW, LATE_WINDOW, GroupSummary, RunSummary

ALGORITHM_ORDER = ("respo", "vespo", "grpo", "gspo")
DISPLAY = {"respo": "ReSPO", "vespo": "VESPO", "grpo": "GRPO", "gspo": "GSPO"}


def _order(algorithm: str) -> tuple[int, str]:
    return (ALGORITHM_ORDER.index(algorithm) if algorithm in ALGORITHM_ORDER else len(ALGORITHM_ORDER), algorithm)


def _pct(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{100.0 * x:.{digits}f}"


def late_score_table(groups: list[GroupSummary]) -> str:
    """Rows: algorithm; columns: N. Cell: late score (%) mean ± std over seeds, and Δ to VESPO in pp with CI."""
    reuses = sorted({g.reuse for g in groups})
    cells = {(g.algorithm, g.reuse): g for g in groups}
    header = "| method | " + " | ".join(f"N = {n}" for n in reuses) + " |"
    lines = [header, "|---|" + "---|" * len(reuses)]
    for algorithm in sorted({g.algorithm for g in groups}, key=_order):
        row = [DISPLAY.get(algorithm, algorithm)]
        for n in reuses:
            g = cells.get((algorithm, n))
            if g is None:
                row.append("—")
                continue
            text = _pct(g.late_mean) + ("" if g.late_std is None else f" ± {_pct(g.late_std)}")
            text += f" (n={len(g.runs)})"
            if g.delta_pp is not None:
                ci = "" if g.delta_ci is None else f" [{g.delta_ci[0]:+.2f}, {g.delta_ci[1]:+.2f}]"
                text += f"<br>{g.delta_pp:+.2f} pp{ci}"
            row.append(text)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def detail_table(groups: list[GroupSummary]) -> str:
    val_keys = sorted({k for g in groups for k in g.val})
    header = ["method", "N", "seeds", "late", "early", "AUC", "resp. length", "starved mass share", *val_keys]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for g in sorted(groups, key=lambda g: (g.reuse, _order(g.algorithm))):
        row = [
            DISPLAY.get(g.algorithm, g.algorithm),
            str(g.reuse),
            ",".join(str(r.seed) for r in g.runs),
            _pct(g.late_mean),
            _pct(g.early_mean),
            _pct(g.auc_mean),
            "—" if g.length_mean is None else f"{g.length_mean:.1f}",
            _pct(g.starved_mass_mean, 1),
            *(_pct(g.val.get(k)) for k in val_keys),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown_report(groups: list[GroupSummary], runs: list[RunSummary], refused: list[str], skipped: list[str]) -> str:
    parts = [
        "## Late training score (%)",
        "",
        f"Mean of (reward + 1) / 2 over the last {LATE_WINDOW} optimizer steps of each run; mean ± std over seeds "
        f"(n = seeds); second line: difference to {DISPLAY[BASELINE]} at the same N in percentage points with a "
        f"{int(CONFIDENCE * 100)}% Welch t interval.",
        "",
        late_score_table(groups) if groups else "(no group to report)",
        "",
        "## Details",
        "",
        f"early: first {EARLY_WINDOW} optimizer steps; AUC: mean score over all optimizer steps; resp. length: mean "
        "response length over the run; starved mass share: share of the coefficient mass Σφ·|A|·tokens held by "
        "positive responses with log W < −1, mean over the run (logged by the respo/vespo losses); validation "
        "columns: last logged value.",
        "",
        detail_table(groups) if groups else "(none)",
    ]
    notes = [f"- {r.name}: {n}" for r in runs for n in r.notes]
    if refused or notes or skipped:
        parts += ["", "## What was not used", ""]
        parts += [f"- {line}" for line in refused]
        parts += notes
        if skipped:
            parts.append(f"- {len(skipped)} log lines or values skipped, e.g.:")
            parts += [f"  - {s}" for s in skipped[:10]]
    return "\n".join(parts) + "\n"


def plot_scores(groups: list[GroupSummary], out_dir: Path) -> list[Path]:
    """One PNG per N: mean score over seeds against optimizer step per algorithm, ± std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    by_reuse = defaultdict(list)
    for g in groups:
        by_reuse[g.reuse].append(g)
    for reuse, members in sorted(by_reuse.items()):
        fig, ax = plt.subplots(figsize=(7, 4))
        for g in sorted(members, key=lambda g: _order(g.algorithm)):
            horizon = max(len(r.curve) for r in g.runs)
            mean, low, high = [], [], []
            for i in range(horizon):
                values = [r.curve[i] for r in g.runs if i < len(r.curve)]
                m = sum(values) / len(values)
                sd = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
                mean.append(m)
                low.append(m - sd)
                high.append(m + sd)
            steps = range(1, horizon + 1)
            (line,) = ax.plot(steps, mean, label=f"{DISPLAY.get(g.algorithm, g.algorithm)} ({len(g.runs)} seeds)")
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training score (reward + 1) / 2")
        ax.set_title(f"N = {reuse}: mean over seeds, band ± 1 std")
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"score_n{reuse}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_starved_mass(groups: list[GroupSummary], logs_by_run: dict, out_dir: Path) -> Path | None:
    """Starved coefficient-mass share against optimizer step, for runs whose loss logs it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from respo_verl.report.analysis import STARVED_MASS_PATTERN

    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = 0
    for g in sorted(groups, key=lambda g: (g.reuse, _order(g.algorithm))):
        for r in g.runs:
            log = logs_by_run[r.name]
            keys = [k for k in log.metrics if STARVED_MASS_PATTERN.match(k)]
            if not keys:
                continue
            series = log.series(keys[0])
            steps = sorted(series)
            ax.plot([s * g.reuse for s in steps], [100 * series[s] for s in steps], alpha=0.7,
                    label=f"{DISPLAY.get(g.algorithm, g.algorithm)} N={g.reuse} s{r.seed}")  # fmt: skip
            drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("starved positives' share of coefficient mass (%)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out_dir / "starved_mass_share.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
