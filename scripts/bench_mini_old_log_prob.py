"""π_old of a `respo-verl mini` rollout batch in one piece and in pieces of rows, side by side in one process.

Times ``response_log_prob`` on a whole rollout batch (128 prompts × 8 answers of the full response budget) and
``response_log_prob_no_grad`` at a few piece sizes, alternating them ``--repeats`` times, and prints each median time
and its ratio to the one-piece forward, and whether the numbers are equal.

Usage: python scripts/bench_mini_old_log_prob.py [--repeats 3] [--rows 256,64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from respo_verl.mini import model as model_lib
from respo_verl.mini import task
from respo_verl.mini.rollout import Rollout, response_log_prob, response_log_prob_no_grad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default="256,64")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model = model_lib.build_model(model_lib.ModelSpec(), 0)
    gen = torch.Generator().manual_seed(0)
    prompts = task.sample_prompts(128, gen).repeat_interleave(8)
    response = torch.randint(task.FILLER_BASE, task.VOCAB_SIZE, (1024, task.MAX_RESPONSE_LEN), generator=gen)
    rollout = Rollout(prompts, response, torch.ones_like(response, dtype=torch.bool))
    sizes = [int(r) for r in args.rows.split(",")]
    times: dict[str, list[float]] = {"whole": [], **{str(r): [] for r in sizes}}
    with torch.no_grad():
        whole = response_log_prob(model, rollout)
        equal = {r: torch.equal(response_log_prob_no_grad(model, rollout, rows=r), whole) for r in sizes}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            response_log_prob(model, rollout)
            times["whole"].append(time.perf_counter() - t0)
            for r in sizes:
                t0 = time.perf_counter()
                response_log_prob_no_grad(model, rollout, rows=r)
                times[str(r)].append(time.perf_counter() - t0)
    base = statistics.median(times["whole"])
    print(f"one piece of 1024 rows: {base:.2f} s (median of {args.repeats})")
    for r in sizes:
        t = statistics.median(times[str(r)])
        print(f"pieces of {r} rows: {t:.2f} s, {base / t:.2f}x faster, numbers equal: {equal[r]}")


if __name__ == "__main__":
    main()
