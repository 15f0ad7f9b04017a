"""A common rate for the second task: the regime of ReSPO's and VESPO's runs at each candidate rate, and no score.

Runs the pair grid's configurations (N = 32, 192 updates, the ``fork`` task, from the shipped base models, else
trained and cached) for each method × candidate rate × seed, prints
each run's regime line and each (method, rate)'s line pooled over its seeds, with its margin
(``regime.RegimeCheck.margin``) and, descriptive, the high tail a diffusing log W would give at its starved share
(``regime.diffusion_high_tail``), then the rate ``protocol.common_regime_rate`` chooses: the one where every
method holds the four checks with the most room, or none. It prints no score
(docs/mini.md, "The second task: no verdict"). The runs are the grid's own (same
configuration, same names), so a grid run into the same ``--out`` later skips those already complete; a probe run
again into it skips them too.

Usage: python experiments/mini/probes/fork_rate_probe.py --out DIR [--task fork] [--lr 3.25e-4,3.5e-4,3.75e-4]
[--algos respo,vespo] [--seeds 0,1] [--workers 2] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from experiments.mini import experiment, fork, protocol, regime, tasks
from experiments.mini import model as model_lib
from experiments.mini.train import RunConfig


class _NoBar:
    """What ``experiment.execute`` updates; the probe prints lines instead of a bar."""

    def update(self, n: int) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass


def configs(algos: list[str], rates: list[float], seeds: list[int], task: str = fork.NAME) -> list[RunConfig]:
    """The pair grid's configuration of each (algorithm, rate, seed) on ``task``, rate-major."""
    return [
        RunConfig(
            algo,
            protocol.GRID_REUSE,
            seed,
            protocol.FULL_OPTIMIZER_STEPS,
            protocol.MINIBATCH_PROMPTS * protocol.GRID_REUSE,
            protocol.GROUP_SIZE,
            lr,
            warm_seed=protocol.warm_seed(seed),
            task=task,
        )
        for lr in rates
        for seed in seeds
        for algo in algos
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="where the runs' logs go (the grid's --out)")
    parser.add_argument("--task", choices=[t for t in tasks.NAMES if tasks.get(t).high_tail], default=fork.NAME)
    parser.add_argument("--lr", default=",".join(f"{x:g}" for x in protocol.FORK_RATE_CANDIDATES))
    parser.add_argument("--algos", default=",".join(protocol.VERDICT), help="the methods that must be in the regime")
    parser.add_argument("--seeds", default=",".join(map(str, protocol.FORK_RATE_PROBE_SEEDS)))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=model_lib.DEFAULT_CACHE_DIR, help="base-model cache")
    args = parser.parse_args()
    rates = [float(x) for x in args.lr.split(",")]
    algos = args.algos.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    start = time.perf_counter()
    cfgs = configs(algos, rates, seeds, args.task)
    spec = model_lib.ModelSpec()
    warms = {w: model_lib.WarmStart(seed=w, steps=fork.WARM_START_STEPS) for w in {c.warm_seed for c in cfgs}}
    for w, warm in sorted(warms.items()):
        _, origin = model_lib.warm_start(spec, warm, cache_dir=args.cache_dir, task_name=args.task)
        print(f"base model {w}: {origin}", flush=True)
    experiment.preload(algos)
    jobs = [experiment.Job(c, spec, warms[c.warm_seed], args.cache_dir, args.out, 1, True) for c in cfgs]
    print(f"{len(jobs)} runs on {args.workers} worker(s) into {args.out}", flush=True)
    results = experiment.execute(jobs, args.workers, _NoBar(), resume=True)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)
    for cfg, result in zip(cfgs, results):
        print(f"{cfg.name} ({result.wall_s:.0f} s): {result.regime.line()}", flush=True)
    pooled = {
        (algo, lr): regime.pool(
            protocol.GRID_REUSE,
            [(r.stale_totals, r.stale_shares) for c, r in zip(cfgs, results) if (c.algorithm, c.lr) == (algo, lr)],
        )
        for lr in rates
        for algo in algos
    }
    print(f"pooled over seeds {','.join(map(str, seeds))}:", flush=True)
    for (algo, lr), check in pooled.items():
        print(f"  {algo} lr {lr:g} (margin {check.margin:+.3f}): {check.line()}", flush=True)
        if 0.0 < check.starved_share < 1.0:  # descriptive: what diffusion alone puts above +1 at this starved share
            yardstick = regime.diffusion_high_tail(check.starved_share)
            print(f"    a diffusing log W with this starved share: {100 * yardstick:.1f}% above +1", flush=True)
    chosen = protocol.common_regime_rate(pooled, algos)
    if chosen is None:
        print(f"no candidate rate puts {', '.join(algos)} all in the regime", flush=True)
    else:
        print(f"common rate: {chosen:g}", flush=True)


if __name__ == "__main__":
    main()
