"""``respo-verl demo``: the problem ReSPO solves, in verl's own trainer on this machine's CPU, ReSPO beside VESPO.

The default demo runs ``python -m respo_verl.main_ppo algorithm=<a> +device=cpu +task=cpu_chain`` for ReSPO and then
VESPO with one seed, at rollout reuse N = :data:`REGIME_REUSE`: the chain task's correct answers are long
(``respo_verl/cpu/kit/chain.py``), so the updates that reuse a rollout batch move their log W well below 0. It
prints one line per step and method (the score, the share of positives with log W < −1, the mean φ those positives
get, the starved positives' share of the gradient mass), then ``respo-verl report`` of both runs and a figure
(:data:`FIGURE`): the φ each positive received against its log W, per method, over both kernels' curves, and the
score per step. Over so few steps a difference in score is not a result (docs/mini.md is the experiment); what the
demo shows is the mechanism: starved positives exist under both methods, VESPO gives them almost nothing, ReSPO
keeps weighting them.

``--quick`` runs the former smoke run instead: one method on the addition task, N = 4, 8 steps.

Logs go where verl's file logger puts them: ``$VERL_FILE_LOGGER_PATH`` when set (``--quick`` only), else
``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``, with ``--out`` as the root when neither is set. Each
method's per-sequence kernel trace (``RESPO_VERL_KERNEL_TRACE``, respo_verl/verl/losses.py) goes next to its log.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from respo_verl import algorithms

PROJECT = "respo_verl_cpu"
MINI_BATCH_PROMPTS = 2  # ppo_mini_batch_size of the demo (prompts); the rollout batch is N times that
SAMPLES_PER_PROMPT = 4
REGIME_REUSE = 16  # N of the regime demo: 15 of every 16 updates reuse a stale rollout batch
REGIME_STEPS = 3
REGIME_ALGORITHMS = ("respo", "vespo")
TRACE_ENV = "RESPO_VERL_KERNEL_TRACE"  # respo_verl.verl.losses.TRACE_ENV; not imported: it would import verl
FIGURE = "phi_vs_log_w.png"
POLL_S = 0.5
# The per-step line of the quick run: (metric, label, format); {loss} is the algorithm's metric prefix.
STEP_FIELDS = (
    ("critic/score/mean", "reward", "{:+.2f}"),
    ("actor/{loss}/pos/log_w_mean", "log W+", "{:+.3f}"),
    ("actor/{loss}/neg/log_w_mean", "log W-", "{:+.3f}"),
    ("actor/{loss}/starved_mass_share", "starved mass", "{:.2f}"),
    ("actor/grad_norm", "grad norm", "{:.2f}"),
    ("training/rollout_probs_diff_max", "rollout/actor |Δlog p|max", "{:.1e}"),
    ("timing_s/step", "s", "{:.1f}"),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="respo-verl demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the 8-step smoke run (one method, addition task, N = 4)")
    p.add_argument("--algorithm", default="respo", choices=algorithms.ALGORITHMS, help="--quick: the method")
    p.add_argument("--reuse", type=int, default=None, help=f"N (default {REGIME_REUSE}; --quick: 4)")
    p.add_argument("--steps", type=int, default=None, help=f"training steps (default {REGIME_STEPS}; --quick: 8)")
    p.add_argument("--out", type=Path, default=Path("runs/cpu_demo"), help="output folder (default runs/cpu_demo)")
    p.add_argument("overrides", nargs="*", help="further Hydra overrides for main_ppo")
    return p


def log_path(out: Path, experiment: str) -> Path:
    """Where verl's FileLogger will write, given the environment (see module docstring)."""
    if os.environ.get("VERL_FILE_LOGGER_PATH"):
        return Path(os.environ["VERL_FILE_LOGGER_PATH"]).expanduser().resolve()
    root = Path(os.environ.get("VERL_FILE_LOGGER_ROOT") or out).expanduser().resolve()
    return root / PROJECT / f"{experiment}.jsonl"


def command(
    algorithm: str, reuse: int, steps: int, experiment: str, overrides: list[str], task: str | None = None
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "respo_verl.main_ppo",
        f"algorithm={algorithm}",
        "+device=cpu",
        *([f"+task={task}"] if task else []),
        f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_BATCH_PROMPTS}",
        f"data.train_batch_size={reuse * MINI_BATCH_PROMPTS}",
        f"actor_rollout_ref.rollout.n={SAMPLES_PER_PROMPT}",
        f"trainer.total_training_steps={steps}",
        f"trainer.project_name={PROJECT}",
        f"trainer.experiment_name={experiment}",
        *overrides,
    ]


def loss_name(algorithm: str) -> str:
    """The metric prefix of ``algorithm``'s loss diagnostics (``actor/<name>/...``)."""
    return {"respo": "respo", "vespo": "vespo"}.get(algorithm, algorithm)


def starvation(data: dict, loss: str) -> dict[str, float] | None:
    """The step's starvation figures from its logged counts: the share of positives with log W < −1, the mean φ
    they get (NaN without any), and their share of the gradient mass; None when the loss logs no counts."""
    prefix = f"actor/{loss}/"
    try:
        positives, starved = data[prefix + "pos_count"], data[prefix + "starved_count"]
        phi_sum, mass = data[prefix + "starved_phi_sum"], data[prefix + "starved_mass_share"]
    except KeyError:
        return None
    return {
        "starved_share": starved / positives if positives > 0 else float("nan"),
        "starved_phi": phi_sum / starved if starved > 0 else float("nan"),
        "starved_mass": mass,
    }


def _step_line(step: int, steps: int, data: dict, loss: str = "respo", label: str | None = None) -> str:
    parts = [f"step {step}/{steps}"] if label is None else [f"{label:<6} step {step}/{steps}"]
    figures = starvation(data, loss) if label is not None else None
    if figures is not None:
        score = data.get("critic/score/mean")
        if isinstance(score, int | float):
            parts.append(f"score {score:+.2f}")
        parts.append(f"positives with log W < -1: {figures['starved_share']:.0%}")
        parts.append(f"their mean φ {figures['starved_phi']:.2f}")
        parts.append(f"their gradient mass {figures['starved_mass']:.0%}")
        return "  ".join(parts)
    for key, name, fmt in STEP_FIELDS:
        value = data.get(key.format(loss=loss))
        if isinstance(value, int | float):
            parts.append(f"{name} {fmt.format(value)}")
    return "  ".join(parts)


def follow(process: subprocess.Popen, log: Path, steps: int, loss: str = "respo", label: str | None = None) -> int:
    """Print one line per new log entry until ``process`` exits; returns the number of steps seen."""
    seen, offset = 0, 0
    while True:
        done = process.poll() is not None
        if log.is_file():
            with log.open("rb") as fh:
                fh.seek(offset)
                chunk = fh.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            offset += len(complete)
            for raw in complete.splitlines():
                entry = json.loads(raw)
                if "step" not in entry:  # e.g. the resume marker of a relaunched run
                    continue
                seen += 1
                print(_step_line(int(entry["step"]), steps, entry.get("data", {}), loss, label), flush=True)
        if done:
            return seen
        time.sleep(POLL_S)


def run_record(log: Path, algorithm: str, reuse: int, steps: int, cmd: list[str]):
    from respo_verl.tools.runs.manifest import RunRecord

    return RunRecord(
        name=log.stem,
        algorithm=algorithm,
        reuse=reuse,
        seed=0,
        log=str(log),
        optimizer_steps=steps * reuse,
        config_hash=hashlib.sha256(json.dumps(cmd[3:]).encode()).hexdigest()[:16],
        command=cmd,
        source="verl",
        log_step="training",
    )


def write_manifest(log: Path, algorithm: str, reuse: int, steps: int, cmd: list[str]) -> Path:
    from respo_verl.tools.runs.manifest import write_manifest as write

    return write([run_record(log, algorithm, reuse, steps, cmd)], log.parent)


def _run(cmd: list[str], env: dict, log: Path, trainer_log: Path, steps: int, loss: str, label: str | None) -> bool:
    """Run ``cmd`` with its output in ``trainer_log``, printing its steps; False (and the output's tail) on failure."""
    with trainer_log.open("w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            seen = follow(process, log, steps, loss, label)
        except KeyboardInterrupt:
            process.terminate()
            raise
    if process.returncode != 0 or seen != steps:
        tail = trainer_log.read_text(errors="replace").splitlines()[-25:]
        print("\n".join(tail), file=sys.stderr)
        print(f"respo-verl demo: main_ppo exited with {process.returncode} after {seen} of {steps} steps "
              f"(full output: {trainer_log})", file=sys.stderr)  # fmt: skip
        return False
    return True


def _prepare(log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)


def _report(folder: Path, out: Path) -> int:
    from respo_verl.tools.report.cli import main as report_main

    return report_main([str(folder), "--out", str(out)])


def quick(args: argparse.Namespace) -> int:
    reuse, steps = args.reuse or 4, args.steps or 8
    experiment = f"{args.algorithm}_n{reuse}"
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        log = log_path(args.out, experiment)
        _prepare(log)
    except OSError as exc:
        print(f"respo-verl demo: cannot write the output: {exc}", file=sys.stderr)
        return 2
    cmd = command(args.algorithm, reuse, steps, experiment, args.overrides)
    env = dict(os.environ)
    if not env.get("VERL_FILE_LOGGER_PATH"):
        env["VERL_FILE_LOGGER_ROOT"] = str(log.parent.parent)
    trainer_log = args.out / "main_ppo.log"
    print(f"verl's main_ppo on CPU: {' '.join(['python', *cmd[1:]])}\n(verl's output: {trainer_log}; log: {log})")
    started = time.perf_counter()
    if not _run(cmd, env, log, trainer_log, steps, loss_name(args.algorithm), None):
        return 1
    print(f"{steps} steps in {time.perf_counter() - started:.0f} s", flush=True)
    write_manifest(log, args.algorithm, reuse, steps, cmd)
    return _report(log.parent, args.out / "report")


def regime(args: argparse.Namespace) -> int:
    """ReSPO, then VESPO, on the chain task at N = REGIME_REUSE; the report and the figure of both."""
    reuse, steps = args.reuse or REGIME_REUSE, args.steps or REGIME_STEPS
    if os.environ.get("VERL_FILE_LOGGER_PATH"):
        print("respo-verl demo: VERL_FILE_LOGGER_PATH names one file; the demo writes two runs (unset it, or "
              "use VERL_FILE_LOGGER_ROOT)", file=sys.stderr)  # fmt: skip
        return 2
    runs = []
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        for algorithm in REGIME_ALGORITHMS:
            log = log_path(args.out, f"{algorithm}_n{reuse}")
            _prepare(log)
            trace = log.with_suffix(".trace.jsonl")
            for stale in log.parent.glob(f"{trace.name}.rank*"):
                stale.unlink()
            runs.append((algorithm, log, trace))
    except OSError as exc:
        print(f"respo-verl demo: cannot write the output: {exc}", file=sys.stderr)
        return 2
    print(f"The starvation regime in verl's trainer: the chain task (51-token correct answers), N = {reuse}, "
          f"{steps} steps each, ReSPO then VESPO with one seed.", flush=True)  # fmt: skip
    records = []
    for algorithm, log, trace in runs:
        trace_env = f"+ray_kwargs.ray_init.runtime_env.env_vars.{TRACE_ENV}={trace}"
        cmd = command(algorithm, reuse, steps, log.stem, [trace_env, *args.overrides], task="cpu_chain")
        env = {**os.environ, "VERL_FILE_LOGGER_ROOT": str(log.parent.parent)}
        trainer_log = args.out / f"main_ppo_{algorithm}.log"
        print(f"{algorithm}: python {' '.join(cmd[1:])}\n  (verl's output: {trainer_log})", flush=True)
        if not _run(cmd, env, log, trainer_log, steps, loss_name(algorithm), algorithm):
            return 1
        records.append(run_record(log, algorithm, reuse, steps, cmd))
    from respo_verl.tools.runs.manifest import write_manifest as write

    write(records, runs[0][1].parent)
    status = _report(runs[0][1].parent, args.out / "report")
    figure = args.out / "report" / FIGURE
    plot_mechanism({a: (log, trace) for a, log, trace in runs}, figure)
    print(f"figure: {figure}")
    print("A score difference over so few steps is not a result (docs/mini.md is the experiment). What the demo "
          "shows is the mechanism: the stale positives below log W = -1 and the φ each method gives them.")  # fmt: skip
    return status


def read_trace(trace: Path) -> dict[str, list[float]]:
    """The per-sequence kernel trace of a run (all ranks): ``log_w``, ``phi``, ``adv`` lists, one entry per
    sequence per loss call."""
    rows = {"log_w": [], "phi": [], "adv": []}
    for part in sorted(trace.parent.glob(f"{trace.name}.rank*")):
        for line in part.read_text().splitlines():
            entry = json.loads(line)
            for key in rows:
                rows[key].extend(entry[key])
    return rows


def stale_positives(trace: Path) -> list[tuple[float, float]]:
    """``(log W, φ)`` of every positive a run trained on after its rollout batch went stale (log W ≠ 0 exactly: the
    first update of a rollout batch sees π_θ = π_old)."""
    rows = read_trace(trace)
    return [(w, p) for w, p, a in zip(rows["log_w"], rows["phi"], rows["adv"], strict=True) if a > 0 and w != 0.0]


def plot_mechanism(runs: dict[str, tuple[Path, Path]], path: Path) -> list[str]:
    """One panel per method: φ against log W of every stale positive it trained on, over both kernels' positive
    branch; a last panel: the score per step of each method. Writes ``path``; returns the panels' titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from respo_verl.core.config import ReSPOConfig, VESPOConfig
    from respo_verl.core.kernels import respo_phi, vespo_phi
    from respo_verl.tools.runs.logs import read_log

    grid = torch.linspace(-5.0, 1.0, 301, dtype=torch.float64)
    positive = torch.ones_like(grid, dtype=torch.bool)
    curves = {
        "ReSPO φ₊": respo_phi(grid, positive, ReSPOConfig()).tolist(),
        "VESPO φ₊": vespo_phi(grid, positive, VESPOConfig()).tolist(),
    }
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(4.6 * (len(runs) + 1), 3.8))
    for ax, (algorithm, (_, trace)) in zip(axes, runs.items(), strict=False):
        stale = stale_positives(trace)
        for (name, values), style in zip(curves.items(), ("-", "--"), strict=True):
            ax.plot(grid.tolist(), values, style, color="0.35", lw=1.2, label=name)
        ax.axvline(-1.0, color="0.6", lw=0.8, ls=":")
        if stale:
            ax.scatter(*zip(*stale, strict=True), s=12, alpha=0.6, color="C0" if algorithm == "respo" else "C3")
        starved = [p for w, p in stale if w < -1.0]
        mean = f", mean φ {sum(starved) / len(starved):.2f}" if starved else ""
        ax.set_title(f"{algorithm}: {len(starved)} of {len(stale)} stale positives below log W = -1{mean}", fontsize=8)
        ax.set_xlabel("log W of the sequence")
        ax.set_ylabel("φ it received")
        ax.set_xlim(-5.0, 1.0)
        ax.set_ylim(0.0, 1.6)
        ax.legend(fontsize=7, loc="lower right")
    score_ax = axes[-1]
    for algorithm, (log, _) in runs.items():
        score = read_log(log).series("critic/score/mean")
        score_ax.plot(sorted(score), [score[step] for step in sorted(score)], marker="o", label=algorithm)
    score_ax.xaxis.get_major_locator().set_params(integer=True)
    score_ax.set_xlabel("training step")
    score_ax.set_ylabel("score (reward, ±1)")
    score_ax.set_title("score per step (a few steps: not a result)", fontsize=8)
    score_ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    titles = [ax.get_title() for ax in axes]
    plt.close(fig)
    return titles


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if (args.reuse is not None and args.reuse < 1) or (args.steps is not None and args.steps < 1):
        print("respo-verl demo: --reuse and --steps must be positive integers", file=sys.stderr)
        return 2
    started = time.perf_counter()
    status = quick(args) if args.quick else regime(args)
    print(f"respo-verl demo: {time.perf_counter() - started:.0f} s in all", flush=True)
    return status
