"""Time per verl training step on CPU with ReSPO against verl's ``vanilla`` (PPO-clip) loss.

Each run is a whole ``python -m respo_verl.main_ppo algorithm=<respo|grpo> +device=cpu`` job (the ``grpo`` preset is
verl's ``vanilla`` loss with GRPO advantages; the two jobs differ only in the loss). Runs alternate in ABBA order
(respo, grpo, grpo, respo, ...) so that slow phases of a shared machine hit both alike. From each run's verl file log
the median of ``timing_s/step`` and of ``timing_s/update_actor`` over the steps after the first (which pays for
start-up work) is taken; each pair of runs gives one ratio respo / vanilla, reported with the spread over pairs.
The loss is a small part of a step (generation, old log-probs, the update's forward and backward), so ≈ 1.0 is
expected.

``--measure`` compares instead the ``grpo`` job with and without the method-independent starved-mass measure that
every loss logs (``respo_verl/verl/starvation.py``; ``RESPO_VERL_STARVED_MASS=0`` in the workers switches it off):
the ratio measured / unmeasured is the measure's cost per step (target ≤ 1.02).

Usage::

    .venv/bin/python scripts/bench/cpu_step.py --pairs 2 --steps 6 --json cpu_step.json
    .venv/bin/python scripts/bench/cpu_step.py --measure --pairs 2 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import cpu_name, quartiles, write_json

ALGORITHMS = ("respo", "grpo")  # grpo = verl's vanilla loss
# --measure: the grpo job as it is, and with the starved-mass measure switched off in every Ray worker.
UNMEASURED = "grpo-unmeasured"
MEASURE_CONDITIONS = ("grpo", UNMEASURED)
METRICS = ("timing_s/step", "timing_s/update_actor")
MEASURE_KEY = "actor/starved_mass_share"


def run_once(condition: str, steps: int, reuse: int, workdir: Path) -> dict[str, float]:
    """One main_ppo job; the median of each metric over steps 2..steps."""
    algorithm = "grpo" if condition == UNMEASURED else condition
    log = workdir / f"{condition}-{time.monotonic_ns()}.jsonl"
    ray_tmp = tempfile.mkdtemp(prefix="rv-ray-", dir="/tmp")
    cmd = [
        sys.executable, "-m", "respo_verl.main_ppo", f"algorithm={algorithm}", "+device=cpu",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", f"data.train_batch_size={2 * reuse}",
        f"trainer.total_training_steps={steps}", f"+ray_kwargs.ray_init._temp_dir={ray_tmp}",
    ]  # fmt: skip
    if condition == UNMEASURED:
        cmd.append("+ray_kwargs.ray_init.runtime_env.env_vars.RESPO_VERL_STARVED_MASS='0'")
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(log), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=workdir)
    if proc.returncode != 0:
        sys.exit(f"{algorithm} run failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    lines = [json.loads(line)["data"] for line in log.read_text().splitlines()]
    measured = any(MEASURE_KEY in line for line in lines)
    if measured != (condition != UNMEASURED):
        sys.exit(f"{condition} run: {MEASURE_KEY} logged: {measured}, the condition says otherwise")
    if len(lines) != steps:
        sys.exit(f"{algorithm} run logged {len(lines)} of {steps} steps")
    return {m: statistics.median(line[m] for line in lines[1:]) for m in METRICS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2, help="ABBA pairs of runs (default 2)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    parser.add_argument("--reuse", type=int, default=4, help="rollout reuse N (default 4)")
    parser.add_argument("--json", default=None, help="write the measurements here")
    parser.add_argument("--measure", action="store_true", help="grpo with / without the starved-mass measure")
    args = parser.parse_args()
    if args.pairs < 1 or args.steps < 2:
        parser.error("--pairs must be >= 1 and --steps >= 2")
    workdir = Path(tempfile.mkdtemp(prefix="bench-cpu-step-"))
    conditions = MEASURE_CONDITIONS if args.measure else ALGORITHMS
    first, second = conditions
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in conditions}
    for pair in range(args.pairs):
        order = conditions if pair % 2 == 0 else tuple(reversed(conditions))
        for algorithm in order:
            result = run_once(algorithm, args.steps, args.reuse, workdir)
            runs[algorithm].append(result)
            print(f"pair {pair + 1} {algorithm:5s} " + "  ".join(f"{m} {v:.3f}" for m, v in result.items()), flush=True)
    print(
        f"\n{first} / {second} per pair, {args.pairs} pairs, {args.steps} steps per run "
        f"(median of steps 2..), N = {args.reuse}"
    )
    print(f"{'metric':24s} {first + ' s':>9s} {second + ' s':>10s} {'ratio median':>13s} {'ratio IQR':>16s}")
    report: dict = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "runs": runs,
        "ratios": {},
    }  # fmt: skip
    for metric in METRICS:
        ratios = [r[metric] / v[metric] for r, v in zip(runs[first], runs[second], strict=True)]
        q1, q2, q3 = quartiles(ratios)
        a = statistics.median(r[metric] for r in runs[first])
        b = statistics.median(v[metric] for v in runs[second])
        print(f"{metric:24s} {a:9.3f} {b:10.3f} {q2:13.3f} {f'{q1:.3f}-{q3:.3f}':>16s}")
        report["ratios"][metric] = ratios
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
