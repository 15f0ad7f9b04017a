"""``respo-verl demo``: the problem ReSPO solves, in verl's own trainer on this machine's CPU, ReSPO beside VESPO.

The default demo runs ReSPO and then VESPO with one seed on the chain task at rollout reuse N = :data:`REGIME_REUSE`,
as the two runs of one ``respo-verl sweep`` (:func:`sweep_command`: ``python -m respo_verl.main_ppo algorithm=<a>
+device=cpu +task=cpu_chain`` each): the chain task's correct answers are long (``respo_verl/cpu/kit/chain.py``), so
the updates that reuse a rollout batch move their log W well below 0. It prints one line per step and method from
the runs' logs as the sweep writes them (the score, the share of positives with log W < −1, the mean φ those
positives get, the starved positives' share of the gradient mass), then ``respo-verl report`` of both runs and a
figure (:data:`FIGURE`): ReSPO's and VESPO's φ on the same stale sequences, the positives against log W and the
negatives with log W > +1, over both kernels' curves, so that what differs is the kernel, not the run. Over so few
steps a difference in score is not a result (docs/mini.md is the experiment); what the demo shows is the mechanism:
starved positives exist, VESPO gives them almost nothing, ReSPO keeps weighting them.

Everything goes under ``--out``: the sweep's manifest, its output (:data:`SWEEP_OUTPUT`), each run's log, verl's
output and per-sequence kernel trace in ``logs/`` (``<run>.jsonl``, ``<run>.out``, ``<run>.trace.jsonl.rank<R>``:
``RESPO_VERL_KERNEL_TRACE=beside-log``, respo_verl/verl/losses.py), and the report and figure in ``report/``. Run
again, the sweep skips the complete runs; the demo prints their logged steps and redoes the report and the figure.

``--quick`` runs the former smoke run instead: one method on the addition task, N = 4, 8 steps. Its log goes where
verl's file logger puts it: ``$VERL_FILE_LOGGER_PATH`` when set, else
``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``, with ``--out`` as the root when neither is set.
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
from respo_verl.run.resolvers import run_name

PROJECT = "respo_verl_cpu"
MINI_BATCH_PROMPTS = 2  # ppo_mini_batch_size of the demo (prompts); the rollout batch is N times that
SAMPLES_PER_PROMPT = 4
REGIME_REUSE = 16  # N of the regime demo: 15 of every 16 updates reuse a stale rollout batch
REGIME_STEPS = 3
REGIME_ALGORITHMS = ("respo", "vespo")
TRACE_ENV = "RESPO_VERL_KERNEL_TRACE"  # respo_verl.verl.losses.TRACE_ENV; not imported: it would import verl
TRACE_BESIDE_LOG = "beside-log"  # respo_verl.verl.losses.TRACE_BESIDE_LOG: each run's trace beside its own log
SWEEP_MODEL = "cpu-chain"  # the sweep's model tag: the runs are <model>-<algorithm>-n<N>-s0
QUICK_MODEL = "cpu"  # the --quick run's model tag in its name (the kit's dense model, addition task)
QUICK_SEED = 42  # the --quick run sets no seed: its rollout's is verl's default, which its name carries
SWEEP_OUTPUT = "sweep.txt"  # the sweep's own output, in --out
TAIL_LINES = 25  # lines of a failed sweep's output the demo shows
INTERRUPTED = 130  # the shell's status of a command ended by Ctrl-C
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
    p.add_argument("--force", action="store_true", help="the sweep's --force: replace the runs of --out that were made "
                   "with other settings (their files move to OUT/replaced-<time>/) instead of refusing")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="further Hydra overrides for main_ppo")
    return p


def log_path(out: Path, experiment: str) -> Path:
    """Where verl's FileLogger will write, given the environment (see module docstring)."""
    if os.environ.get("VERL_FILE_LOGGER_PATH"):
        return Path(os.environ["VERL_FILE_LOGGER_PATH"]).expanduser().resolve()
    root = Path(os.environ.get("VERL_FILE_LOGGER_ROOT") or out).expanduser().resolve()
    return root / PROJECT / f"{experiment}.jsonl"


def command(algorithm: str, reuse: int, steps: int, experiment: str, overrides: list[str]) -> list[str]:
    """The ``--quick`` run's ``python -m respo_verl.main_ppo`` line (the regime demo's runs are the sweep's)."""
    return [
        sys.executable,
        "-m",
        "respo_verl.main_ppo",
        f"algorithm={algorithm}",
        "+device=cpu",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_BATCH_PROMPTS}",
        f"data.train_batch_size={reuse * MINI_BATCH_PROMPTS}",
        f"actor_rollout_ref.rollout.n={SAMPLES_PER_PROMPT}",
        f"trainer.total_training_steps={steps}",
        f"trainer.project_name={PROJECT}",
        f"trainer.experiment_name={experiment}",
        *overrides,
    ]


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


def _print_new(log: Path, offset: int, steps: int, loss: str, label: str | None) -> tuple[int, int]:
    """Print the step lines of ``log``'s complete lines after byte ``offset``; returns the new offset and the number
    of steps printed."""
    if not log.is_file():
        return offset, 0
    with log.open("rb") as fh:
        fh.seek(offset)
        chunk = fh.read()
    complete = chunk[: chunk.rfind(b"\n") + 1]
    seen = 0
    for raw in complete.splitlines():
        entry = json.loads(raw)
        if "step" not in entry:  # e.g. the resume marker of a relaunched run
            continue
        seen += 1
        print(_step_line(int(entry["step"]), steps, entry.get("data", {}), loss, label), flush=True)
    return offset + len(complete), seen


def follow(process: subprocess.Popen, log: Path, steps: int, loss: str = "respo", label: str | None = None) -> int:
    """Print one line per new log entry until ``process`` exits; returns the number of steps seen."""
    seen, offset = 0, 0
    while True:
        done = process.poll() is not None
        offset, new = _print_new(log, offset, steps, loss, label)
        seen += new
        if done:
            return seen
        time.sleep(POLL_S)


def write_manifest(log: Path, algorithm: str, reuse: int, steps: int, cmd: list[str]) -> Path:
    """The ``--quick`` run's manifest, beside its log, for the report."""
    from respo_verl.tools.runs.manifest import RunRecord
    from respo_verl.tools.runs.manifest import write_manifest as write

    record = RunRecord(
        name=log.stem,
        algorithm=algorithm,
        reuse=reuse,
        seed=QUICK_SEED,
        log=str(log),
        optimizer_steps=steps * reuse,
        config_hash=hashlib.sha256(json.dumps(cmd[3:]).encode()).hexdigest()[:16],
        command=cmd,
        source="verl",
        log_step="training",
    )
    return write([record], log.parent)


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
    experiment = run_name(QUICK_MODEL, args.algorithm, reuse, QUICK_SEED)
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
    if not _run(cmd, env, log, trainer_log, steps, args.algorithm, None):
        return 1
    print(f"{steps} steps in {time.perf_counter() - started:.0f} s", flush=True)
    write_manifest(log, args.algorithm, reuse, steps, cmd)
    return _report(log.parent, args.out / "report")


def sweep_spec(out: Path, reuse: int, steps: int, overrides: list[str]):
    """The regime demo's two runs as a grid of ``respo-verl sweep`` (:class:`respo_verl.tools.sweep.grid.SweepSpec`):
    ReSPO and VESPO, N = ``reuse``, seed 0, ``steps`` training steps, the chain task, each kernel trace beside its
    run's log, then ``overrides``. Raises ValueError as SweepSpec does."""
    from respo_verl.tools.sweep.grid import SweepSpec

    return SweepSpec(
        algorithms=REGIME_ALGORITHMS,
        reuse=(reuse,),
        seeds=(0,),
        model=SWEEP_MODEL,
        mini_batch=MINI_BATCH_PROMPTS,
        optimizer_steps=steps * reuse,
        base_overrides=(
            "+device=cpu",
            "+task=cpu_chain",
            f"actor_rollout_ref.rollout.n={SAMPLES_PER_PROMPT}",
            f"+ray_kwargs.ray_init.runtime_env.env_vars.{TRACE_ENV}={TRACE_BESIDE_LOG}",
            *overrides,
        ),
        out_dir=out,
    )


def sweep_command(spec, force: bool = False) -> list[str]:
    """``python -m respo_verl.cli sweep ...`` of ``spec`` (a :func:`sweep_spec`), with this interpreter."""
    return [
        sys.executable, "-m", "respo_verl.cli", "sweep",
        "--out", str(spec.out_dir), "--model", spec.model, "--algos", ",".join(spec.algorithms),
        "--reuse", ",".join(map(str, spec.reuse)), "--seeds", ",".join(map(str, spec.seeds)),
        "--mini-batch", str(spec.mini_batch), "--optimizer-steps", str(spec.optimizer_steps),
        *(["--force"] if force else []),
        "--", *spec.base_overrides,
    ]  # fmt: skip


def trace_of(log: Path) -> Path:
    """A run's kernel trace (without its ``.rank<R>`` suffixes): beside its log, as ``beside-log`` puts it."""
    return log.with_suffix(".trace.jsonl")


def _started_afresh(records: list, out: Path, force: bool) -> list:
    """The runs the sweep will start rather than skip: those without a complete log and, with ``--force``, those
    whose files it moves away; none when it will refuse ``out`` (another grid or other settings, no ``--force``)."""
    from respo_verl.tools.sweep.runner import SweepConflict, check_same_sweep, is_complete, stale_files

    try:
        check_same_sweep(records, out)
        moved: set[str] = set()
    except SweepConflict:
        if not force:
            return []  # the sweep refuses, saying why, and starts nothing
        try:
            moved = {name for name, _ in stale_files(records, out)}
        except SweepConflict:
            return []  # refused too (a manifest naming files outside the sweep's folders)
    return [r for r in records if r.name in moved or not is_complete(r, out)]


def follow_sweep(sweep: subprocess.Popen, records: list, out: Path) -> None:
    """Print the step lines of each run's log in turn while ``sweep`` runs: a run's until its log is complete or the
    sweep has ended (a complete run that the sweep skipped prints its logged steps at once)."""
    from respo_verl.tools.sweep.runner import is_complete, log_path

    for record in records:
        log, offset = log_path(record, out), 0
        while True:
            finished = sweep.poll() is not None or is_complete(record, out)
            offset, _ = _print_new(log, offset, record.last_log_step, record.algorithm, record.algorithm)
            if finished:
                break
            time.sleep(POLL_S)


def regime(args: argparse.Namespace) -> int:
    """ReSPO, then VESPO, on the chain task at N = REGIME_REUSE, through ``respo-verl sweep``; the report and the
    figure of both."""
    from respo_verl.tools.sweep.grid import expand
    from respo_verl.tools.sweep.runner import log_path

    reuse, steps = args.reuse or REGIME_REUSE, args.steps or REGIME_STEPS
    try:
        spec = sweep_spec(args.out, reuse, steps, args.overrides)
        records = expand(spec, compose=False)  # the sweep composes them; here: their names and logs
    except ValueError as exc:
        print(f"respo-verl demo: {exc}", file=sys.stderr)
        return 2
    output = args.out / SWEEP_OUTPUT
    runs = {r.algorithm: (log_path(r, args.out), trace_of(log_path(r, args.out))) for r in records}
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        for record in _started_afresh(records, args.out, args.force):  # a trace holds the run's last attempt only
            trace = runs[record.algorithm][1]
            for stale in trace.parent.glob(f"{trace.name}.rank*"):
                stale.unlink()
        output.write_bytes(b"")
    except OSError as exc:
        print(f"respo-verl demo: cannot write the output: {exc}", file=sys.stderr)
        return 2
    cmd = sweep_command(spec, args.force)
    print(f"The starvation regime in verl's trainer: the chain task (51-token correct answers), N = {reuse}, "
          f"{steps} steps each, ReSPO then VESPO with one seed, as one sweep:\n"
          f"python {' '.join(cmd[1:])}\n(the sweep's output: {output}; each run's log, verl's output and "
          f"kernel trace: {args.out / 'logs'})", flush=True)  # fmt: skip
    with output.open("w") as fh:
        sweep = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            follow_sweep(sweep, records, args.out)
            sweep.wait()  # the last run's log is complete before its driver and the sweep have ended
        except KeyboardInterrupt:  # the sweep got it too (same terminal): it stops its run, which saves
            print("respo-verl demo: interrupted; waiting for the sweep to stop its run (the same command resumes)",
                  file=sys.stderr, flush=True)  # fmt: skip
            sweep.wait()
            return INTERRUPTED
    if sweep.returncode != 0:
        tail = output.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        print("\n".join(tail), file=sys.stderr)
        print(f"respo-verl demo: the sweep exited with {sweep.returncode} (its output: {output})", file=sys.stderr)
        return sweep.returncode
    status = _report(args.out, args.out / "report")
    figure = args.out / "report" / FIGURE
    plot_mechanism(runs, figure)
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


def stale_sequences(traces: list[Path]) -> dict[str, list[float]]:
    """log W of the stale sequences of all ``traces`` (log W ≠ 0 exactly), by group: ``positives`` (A > 0) and
    ``negatives_high`` (A < 0 with log W > +1, the over-generated tail ReSPO's negative branch damps)."""
    out = {"positives": [], "negatives_high": []}
    for trace in traces:
        rows = read_trace(trace)
        for w, a in zip(rows["log_w"], rows["adv"], strict=True):
            if w == 0.0:
                continue
            if a > 0:
                out["positives"].append(w)
            elif a < 0 and w > 1.0:
                out["negatives_high"].append(w)
    return out


def both_kernels(log_w: list[float], positive: bool) -> dict[str, list[float]]:
    """φ of ReSPO and of VESPO (default knobs, the branch of the advantage's sign) at each of these log W: the two
    kernels on the same sequences. Within ±20, where both clamps are idle, the two methods form the same log W."""
    import torch

    from respo_verl.core.config import ReSPOConfig, VESPOConfig
    from respo_verl.core.kernels import respo_phi, vespo_phi

    values = torch.tensor(log_w, dtype=torch.float64)
    branch = torch.full_like(values, positive, dtype=torch.bool)
    return {
        "respo": respo_phi(values, branch, ReSPOConfig()).tolist(),
        "vespo": vespo_phi(values, branch, VESPOConfig()).tolist(),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def plot_mechanism(runs: dict[str, tuple[Path, Path]], path: Path) -> list[str]:
    """ReSPO's and VESPO's φ on the same stale sequences (those of every run in ``runs``, pooled), over both kernels'
    curves: the positives against log W, and the negatives with log W > +1. Writes ``path``; returns the two panels'
    titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    sequences = stale_sequences([trace for _, trace in runs.values()])
    panels = (
        ("positives", True, (-5.0, 1.0), "φ₊"),
        ("negatives_high", False, (-1.0, 4.0), "φ₋"),
    )
    style = {"respo": ("ReSPO", "C0", "-"), "vespo": ("VESPO", "C3", "--")}
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 4.0))
    for ax, (group, positive, (lo, hi), symbol) in zip(axes, panels, strict=True):
        log_w = sequences[group]
        hi = hi if positive else max(hi, max(log_w, default=hi) + 0.25)  # every negative of the tail on the panel
        grid = torch.linspace(lo, hi, 301, dtype=torch.float64).tolist()
        curves = both_kernels(grid, positive)
        phi = both_kernels(log_w, positive)
        for method, (name, color, line) in style.items():
            ax.plot(grid, curves[method], line, color=color, lw=1.2, label=f"{name} {symbol}")
        for w, a, b in zip(log_w, phi["respo"], phi["vespo"], strict=True):
            ax.plot([w, w], [a, b], color="0.8", lw=0.5, zorder=1)
        for method, (_, color, _) in style.items():
            ax.scatter(log_w, phi[method], s=10, alpha=0.7, color=color, zorder=2)
        ax.axvline(-1.0 if positive else 1.0, color="0.6", lw=0.8, ls=":")
        shown = [i for i, w in enumerate(log_w) if w < -1.0] if positive else list(range(len(log_w)))
        means = f"their mean φ under ReSPO {_mean([phi['respo'][i] for i in shown]):.2f}, under VESPO " + (
            f"{_mean([phi['vespo'][i] for i in shown]):.2f}"
        )
        if positive:
            title = f"the same {len(log_w)} stale positives, {len(shown)} below log W = -1:\n{means}"
        elif log_w:
            title = f"the same {len(log_w)} stale negatives with log W > +1:\n{means}"
        else:
            title = "no stale negative with log W > +1 in these runs"
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("log W of the sequence")
        ax.set_ylabel(f"{symbol}(W) of each kernel")
        ax.set_xlim(lo, hi)
        ax.set_ylim(0.0, 1.6)
        ax.legend(fontsize=7, loc="upper right" if positive else "upper left")
    fig.suptitle(f"φ of both kernels on the stale sequences of the runs ({', '.join(runs)}), pooled", fontsize=9)
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
    if args.quick and args.force:
        print("respo-verl demo: --force is the regime demo's (its sweep's); --quick runs no sweep", file=sys.stderr)
        return 2
    started = time.perf_counter()
    status = quick(args) if args.quick else regime(args)
    print(f"respo-verl demo: {time.perf_counter() - started:.0f} s in all", flush=True)
    return status
