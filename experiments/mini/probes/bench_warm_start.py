"""One warm-start step of the miniature on the right-padded batch and in length buckets, side by side.

Builds warm-start batches of the default recipe (``model._sft_batch``: complete chains and chains broken off at
every length) and times the loss and its backward both ways, alternating them ``--repeats`` times: the whole batch
padded to the response budget, and ``model.log_likelihood`` (rows sorted by length into four forwards, each cut to
its longest row). Prints each median time, the ratio and the largest difference of the losses.

Usage: python experiments/mini/probes/bench_warm_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from experiments.mini import model as model_lib
from experiments.mini.rollout import response_log_prob


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = model_lib.build_model(model_lib.ModelSpec(), 0).train()
    gen = torch.Generator().manual_seed(0)
    batches = [model_lib._sft_batch(model_lib.WarmStart(), gen) for _ in range(args.repeats)]

    def padded(batch):
        return torch.where(batch.response_mask, response_log_prob(model, batch), 0.0).sum()

    def bucketed(batch):
        return model_lib.log_likelihood(model, batch)

    times: dict[str, list[float]] = {"padded": [], "in buckets": []}
    gap = 0.0
    for batch in batches:
        losses = []
        for name, loss_of in (("padded", padded), ("in buckets", bucketed)):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = loss_of(batch)
            loss.backward()
            times[name].append(time.perf_counter() - t0)
            losses.append(loss.item())
        gap = max(gap, abs(losses[0] - losses[1]) / abs(losses[0]))
    base = statistics.median(times["padded"])
    fast = statistics.median(times["in buckets"])
    print(f"padded batch: {base:.3f} s per step (median of {args.repeats})")
    print(f"in length buckets: {fast:.3f} s per step, {base / fast:.2f}x faster; largest relative loss gap {gap:.1e}")


if __name__ == "__main__":
    main()
