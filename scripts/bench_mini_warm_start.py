"""One warm-start step of `respo-verl mini` on the right-padded batch and by response length, side by side.

Builds warm-start batches of the default recipe (``model._sft_batch``: about two thirds are ``? <eos>``, the rest
worked answers) and times the loss and its backward both ways, alternating them ``--repeats`` times: the whole
batch padded to the response budget, as the warm start used to run, and ``model._weighted_log_prob`` (one forward
per response length). Prints each median time, the ratio and the largest difference of the losses.

Usage: python scripts/bench_mini_warm_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from respo_verl.mini import model as model_lib
from respo_verl.mini.rollout import response_log_prob


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = model_lib.build_model(model_lib.ModelSpec(), 0).train()
    gen = torch.Generator().manual_seed(0)
    batches = [model_lib._sft_batch(model_lib.WarmStart(), gen) for _ in range(args.repeats)]

    def padded(batch, weight):
        return (response_log_prob(model, batch) * weight * batch.response_mask).sum()

    def by_length(batch, weight):
        return model_lib._weighted_log_prob(model, batch, weight)

    times: dict[str, list[float]] = {"padded": [], "by length": []}
    gap = 0.0
    for batch, weight in batches:
        losses = []
        for name, loss_of in (("padded", padded), ("by length", by_length)):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = loss_of(batch, weight)
            loss.backward()
            times[name].append(time.perf_counter() - t0)
            losses.append(loss.item())
        gap = max(gap, abs(losses[0] - losses[1]) / abs(losses[0]))
    base = statistics.median(times["padded"])
    fast = statistics.median(times["by length"])
    print(f"padded batch: {base:.3f} s per step (median of {args.repeats})")
    print(f"by response length: {fast:.3f} s per step, {base / fast:.2f}x faster; largest relative loss gap {gap:.1e}")


if __name__ == "__main__":
    main()
