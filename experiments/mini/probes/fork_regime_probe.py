"""The second task's regime, and nothing else: ReSPO at N = 32 from the task's base model, one run per rate.

Prints, per learning rate, the run's regime line (the four checks of ``experiments.mini.regime``, the high tail
included) and, per rollout batch, how the answers of its first mini-batch ended (``mini/<ending>_frac``). It prints
no score: it is how the versions of the fork task were judged before any method was compared on them (docs/mini.md at
commit adefddf, its section on how the second task got here). A version is a setting of the constants of
``experiments/mini/fork.py``; its base model is loaded when shipped, else trained (``fork.WARM_START_STEPS`` steps)
and cached.

Usage: python experiments/mini/probes/fork_regime_probe.py [--task fork] [--warm-seed 0] [--lr 3e-4,3.5e-4]
[--updates 192] [--cache-dir DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from experiments.mini import fork, protocol, regime, tasks
from experiments.mini import model as model_lib
from experiments.mini.train import RunConfig, train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=[t for t in tasks.NAMES if tasks.get(t).high_tail], default=fork.NAME)
    parser.add_argument("--warm-seed", type=int, default=0, help="warm seed (also the RL seed)")
    parser.add_argument("--lr", default="3e-4,3.5e-4", help="comma-separated learning rates")
    parser.add_argument("--updates", type=int, default=protocol.FULL_OPTIMIZER_STEPS, help="updates per run")
    parser.add_argument("--cache-dir", type=Path, default=model_lib.DEFAULT_CACHE_DIR, help="base-model cache")
    parser.add_argument("--out", type=Path, default=None, help="where the runs' logs go (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()
    warm = model_lib.WarmStart(seed=args.warm_seed, steps=fork.WARM_START_STEPS)
    base, origin = model_lib.warm_start(model_lib.ModelSpec(), warm, cache_dir=args.cache_dir, task_name=args.task)
    key = model_lib.recipe_key(model_lib.ModelSpec(), warm, args.task)
    print(f"base model {key}: {origin} ({time.perf_counter() - start:.0f} s)", flush=True)
    endings = tuple(f"mini/{name}_frac" for name in tasks.get(args.task).ending_metrics)
    out = args.out or Path(tempfile.mkdtemp(prefix="fork_probe_"))
    for lr in (float(x) for x in args.lr.split(",")):
        start = time.perf_counter()
        cfg = RunConfig(
            "respo",
            reuse=regime.REGIME_REUSE,
            seed=args.warm_seed,
            warm_seed=args.warm_seed,
            optimizer_steps=args.updates,
            rollout_prompts=protocol.MINIBATCH_PROMPTS * regime.REGIME_REUSE,
            group_size=protocol.GROUP_SIZE,
            lr=lr,
            task=args.task,
        )
        result = train(cfg, base, out)
        print(f"lr {lr:g} ({time.perf_counter() - start:.0f} s): {result.regime.line()}", flush=True)
        firsts = [r["data"] for r in result.records if r["data"].get("mini/minibatch") == 0]
        for batch, data in enumerate(firsts):
            shares = ", ".join(f"{k.split('/')[1].removesuffix('_frac')} {100 * data[k]:.1f}%" for k in endings)
            print(f"  rollout batch {batch}: {shares}", flush=True)


if __name__ == "__main__":
    main()
