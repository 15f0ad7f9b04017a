"""``respo-verl demo``: a real verl run with ReSPO on this machine's CPU, one line per step, then its report.

It runs ``python -m respo_verl.main_ppo algorithm=<algorithm> +device=cpu`` with rollout reuse N
(``train_batch_size = N × ppo_mini_batch_size``) and verl's file logger on, prints a line per training step as the
log grows, writes a run manifest next to the log, and ends with ``respo-verl report`` of the run: the score curve and
ReSPO's diagnostics. verl's own output goes to ``<out>/main_ppo.log``.

The log goes where verl's file logger puts it: ``$VERL_FILE_LOGGER_PATH`` when set, else
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

PROJECT = "respo_verl_cpu"
MINI_BATCH_PROMPTS = 2  # ppo_mini_batch_size of the demo (prompts); the rollout batch is N times that
SAMPLES_PER_PROMPT = 4
POLL_S = 0.5
# The per-step line: (metric, label, format).
STEP_FIELDS = (
    ("critic/score/mean", "reward", "{:+.2f}"),
    ("actor/respo/pos/log_w_mean", "log W+", "{:+.3f}"),
    ("actor/respo/neg/log_w_mean", "log W-", "{:+.3f}"),
    ("actor/respo/starved_mass_share", "starved mass", "{:.2f}"),
    ("actor/grad_norm", "grad norm", "{:.2f}"),
    ("training/rollout_probs_diff_max", "rollout/actor |Δlog p|max", "{:.1e}"),
    ("timing_s/step", "s", "{:.1f}"),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="respo-verl demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithm", default="respo", choices=algorithms.ALGORITHMS)
    p.add_argument("--reuse", type=int, default=4, help="N, optimizer updates per rollout batch (default 4)")
    p.add_argument("--steps", type=int, default=8, help="training steps (rollout batches), default 8")
    p.add_argument("--out", type=Path, default=Path("runs/cpu_demo"), help="output folder (default runs/cpu_demo)")
    p.add_argument("overrides", nargs="*", help="further Hydra overrides for main_ppo")
    return p


def log_path(out: Path, experiment: str) -> Path:
    """Where verl's FileLogger will write, given the environment (see module docstring)."""
    if os.environ.get("VERL_FILE_LOGGER_PATH"):
        return Path(os.environ["VERL_FILE_LOGGER_PATH"]).expanduser().resolve()
    root = Path(os.environ.get("VERL_FILE_LOGGER_ROOT") or out).expanduser().resolve()
    return root / PROJECT / f"{experiment}.jsonl"


def command(algorithm: str, reuse: int, steps: int, experiment: str, overrides: list[str]) -> list[str]:
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


def _step_line(step: int, steps: int, data: dict) -> str:
    parts = [f"step {step}/{steps}"]
    for key, label, fmt in STEP_FIELDS:
        value = data.get(key)
        if isinstance(value, int | float):
            parts.append(f"{label} {fmt.format(value)}")
    return "  ".join(parts)


def follow(process: subprocess.Popen, log: Path, steps: int) -> int:
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
                seen += 1
                print(_step_line(int(entry["step"]), steps, entry.get("data", {})), flush=True)
        if done:
            return seen
        time.sleep(POLL_S)


def write_manifest(log: Path, algorithm: str, reuse: int, steps: int, cmd: list[str]) -> Path:
    from respo_verl.tools.runs.manifest import RunRecord, write_manifest

    record = RunRecord(
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
    return write_manifest([record], log.parent)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.reuse < 1 or args.steps < 1:
        print("respo-verl demo: --reuse and --steps must be positive integers", file=sys.stderr)
        return 2
    experiment = f"{args.algorithm}_n{args.reuse}"
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        log = log_path(args.out, experiment)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)
    except OSError as exc:
        print(f"respo-verl demo: cannot write the output: {exc}", file=sys.stderr)
        return 2
    cmd = command(args.algorithm, args.reuse, args.steps, experiment, args.overrides)
    env = dict(os.environ)
    if not env.get("VERL_FILE_LOGGER_PATH"):
        env["VERL_FILE_LOGGER_ROOT"] = str(log.parent.parent)
    trainer_log = args.out / "main_ppo.log"
    shown = " ".join(["python", *cmd[1:]])
    print(f"verl's main_ppo on CPU: {shown}\n(verl's output: {trainer_log}; log: {log})", flush=True)
    started = time.perf_counter()
    with trainer_log.open("w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            seen = follow(process, log, args.steps)
        except KeyboardInterrupt:
            process.terminate()
            raise
    if process.returncode != 0 or seen != args.steps:
        tail = trainer_log.read_text(errors="replace").splitlines()[-25:]
        print("\n".join(tail), file=sys.stderr)
        print(f"respo-verl demo: main_ppo exited with {process.returncode} after {seen} of {args.steps} steps "
              f"(full output: {trainer_log})", file=sys.stderr)  # fmt: skip
        return process.returncode or 1
    print(f"{seen} steps in {time.perf_counter() - started:.0f} s", flush=True)
    write_manifest(log, args.algorithm, args.reuse, args.steps, cmd)
    from respo_verl.tools.report.cli import main as report_main

    return report_main([str(log.parent), "--out", str(args.out / "report")])
