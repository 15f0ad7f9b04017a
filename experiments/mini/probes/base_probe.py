"""Measure a base model of the miniature at temperature 1: how often it completes the chain, and how it breaks off.

For a rollout batch (128 prompts × 8 answers, as an RL run's first batch) it prints the success, the shares of
answers that gave up, slipped or broke off otherwise, the mean lengths of correct and wrong answers, the success by
the prompt's digit sum (its difficulty), and along the complete answers, per tenth of the chain: the model's mean
probability of breaking off at a step (everything but the step's words) and the entropy of its words there (the data
have ln 4 ≈ 1.386 nats).

Usage: python experiments/mini/probes/base_probe.py [--seed 0] [--sample-seed 1000003] [--prompts 128]
(the base model is the package's, or comes from the cache, or is trained and cached).
"""

from __future__ import annotations

import argparse
import time

import torch

from experiments.mini import model as model_lib
from experiments.mini import task
from experiments.mini.rollout import _positions, sample

PARTS = 10


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0, help="warm seed")
    parser.add_argument("--sample-seed", type=int, default=1_000_003)
    parser.add_argument("--prompts", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    warm = model_lib.WarmStart(seed=args.seed)
    t0 = time.perf_counter()
    model, origin = model_lib.warm_start(model_lib.ModelSpec(), warm)
    print(f"warm start {warm}: {origin} ({time.perf_counter() - t0:.0f} s)")
    prompts = task.sample_prompts(args.prompts, torch.Generator().manual_seed(0)).repeat_interleave(8)
    rollout = sample(model, prompts, task.MAX_RESPONSE_LEN, torch.Generator().manual_seed(args.sample_seed))
    correct = task.verify(rollout.response) > 0
    ending = task.ending(rollout.response)
    lengths = rollout.response_mask.sum(dim=1).float()
    print(
        f"success {correct.float().mean():.1%}; gave up {(ending == 1).float().mean():.1%}, slipped "
        f"{(ending == 2).float().mean():.1%}, other {(ending == 3).float().mean():.1%}; mean length correct "
        f"{lengths[correct].mean():.1f}, wrong {lengths[~correct].mean():.1f}"
    )
    sums = prompts.digits.sum(dim=1)
    print(
        "success by digit sum: "
        + ", ".join(
            f"{lo}-{hi} {correct[(sums >= lo) & (sums <= hi)].float().mean():.1%}"
            for lo, hi in ((0, 4), (5, 7), (8, 12))
        )
    )
    complete = rollout.rows(torch.nonzero(correct).flatten())
    with torch.no_grad():
        ids = torch.cat([complete.prompts.input_ids, complete.response], dim=1)
        mask = torch.cat([complete.prompts.attention_mask, complete.response_mask.long()], dim=1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits.float()
        probs = logits[:, task.PROMPT_LEN : task.PROMPT_LEN + task.N_STEPS].softmax(dim=-1)  # (C, S, V): step k's
    steps = torch.arange(task.N_STEPS)
    in_step = torch.zeros(task.N_STEPS, task.VOCAB_SIZE, dtype=torch.bool)
    for v in range(task.WORDS_PER_STEP):
        in_step[steps, task.word(steps, v)] = True
    words = torch.where(in_step, probs, 0.0)  # (C, S, V)
    break_off = 1.0 - words.sum(dim=-1)  # (C, S)
    p = words / words.sum(dim=-1, keepdim=True)
    entropy = -(torch.where(p > 0, p * p.clamp(min=1e-30).log(), 0.0)).sum(dim=-1)  # (C, S)
    print("per tenth of the chain (complete answers): break-off probability per step, word entropy (nats)")
    for part in steps.chunk(PARTS):
        print(
            f"  steps {int(part[0]) + 1}-{int(part[-1]) + 1}: {break_off[:, part].mean():.4f}, "
            f"{entropy[:, part].mean():.3f}"
        )


if __name__ == "__main__":
    main()
