"""Measure a `respo-verl mini` base model at temperature 1: how certain its arithmetic is when it samples.

For a rollout batch (128 prompts × 8 answers, as an RL run's first batch) it prints the success, the shares of
worked, given-up and premature answers, the mean lengths of correct and wrong answers, and per step i = 1..K of the
worked steps the model sampled:

- sampled accuracy of the digit copy and of the running sum, each given the model's own prefix (the running sum is
  right when it equals the previous *written* sum plus the written digit);
- the model's mean probability of the right token there, and the share of those positions where it is below 0.99.

Usage: python scripts/mini_base_probe.py [--steps S] [--arith-weight W] [--seed 0] [--sample-seed 1000003]
(the other warm-start settings are the defaults of ``respo_verl.mini.model.WarmStart``; the base model is the
package's, or comes from the cache, or is trained and cached).
"""

from __future__ import annotations

import argparse
import time

import torch

from respo_verl.mini import model as model_lib
from respo_verl.mini import task
from respo_verl.mini.rollout import Rollout, response_log_prob, sample

# The data's fillers (task.filler_sequence): 1/16 for each filler, plus 1/6 for each of the three successors.
_P = torch.tensor([1 / 16 + 1 / 6] * 3 + [1 / 16] * 5)
FILLER_ENTROPY = float(-(_P * _P.log()).sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--arith-weight", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-seed", type=int, default=1_000_003)
    parser.add_argument("--prompts", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    overrides = {k: v for k, v in (("steps", args.steps), ("arith_weight", args.arith_weight)) if v is not None}
    warm = model_lib.WarmStart(seed=args.seed, **overrides)
    t0 = time.perf_counter()

    def progress(step: int) -> None:
        if step % 250 == 0:
            print(f"warm-start step {step}/{warm.steps}, {time.perf_counter() - t0:.0f} s", flush=True)

    model, origin = model_lib.warm_start(model_lib.ModelSpec(), warm, on_step=progress)
    print(f"warm start {warm}: {origin} ({time.perf_counter() - t0:.0f} s)")
    prompts = task.sample_prompts(args.prompts, torch.Generator().manual_seed(0)).repeat_interleave(8)
    rollout = sample(model, prompts, task.MAX_RESPONSE_LEN, torch.Generator().manual_seed(args.sample_seed))
    with torch.no_grad():
        logits_lp = response_log_prob(model, rollout)  # (B, T) log-prob of the sampled tokens
    reward = task.verify(rollout.response, prompts.answer)
    lengths = rollout.response_mask.sum(dim=1).float()
    steps = task.completed_steps(rollout.response)
    correct = reward > 0
    print(
        f"success {correct.float().mean():.1%}, worked to the end {(steps == task.N_DIGITS).float().mean():.1%}, "
        f"of those correct {correct[steps == task.N_DIGITS].float().mean():.1%}, given up (`? <eos>`) "
        f"{(rollout.response[:, 0] == task.GIVE_UP).float().mean():.1%}, direct guesses "
        f"{(rollout.response[:, 0] == task.ANS).float().mean():.1%}"
    )
    print(f"mean length correct / wrong: {lengths[correct].mean():.1f} / {lengths[~correct].mean():.1f}")
    worked = rollout.response[:, 0] == task.THINK
    rows_info = []
    for i in range(task.N_DIGITS):
        d_pos = 1 + i * task.STEP_LEN + task.FILLERS_PER_STEP
        s_pos = d_pos + 1
        has = worked & (steps > i)
        rows_info.append((i, d_pos, s_pos, has))
    r_digit, r_sum = {}, {}
    for i, d_pos, s_pos, _ in rows_info:
        prev_sum = (
            torch.zeros_like(prompts.answer) if i == 0 else rollout.response[:, s_pos - task.STEP_LEN] - task.NUM_BASE
        )
        want_digit = task.num(prompts.digits[:, i])
        want_sum = task.num(prev_sum + rollout.response[:, d_pos] - task.NUM_BASE)
        r_digit[i], r_sum[i] = want_digit, want_sum.clamp(task.NUM_BASE, task.VOCAB_SIZE - 1)
    # Two teacher-forced passes: one with the right digit at d_pos (for its probability), one with the right sum.
    p_digit, p_sum = {}, {}
    for kind in ("digit", "sum"):
        forced = rollout.response.clone()
        for i, d_pos, s_pos, has in rows_info:
            pos, want = (d_pos, r_digit[i]) if kind == "digit" else (s_pos, r_sum[i])
            forced[has, pos] = want[has]
        with torch.no_grad():
            lp = response_log_prob(model, Rollout(prompts, forced, rollout.response_mask))
        for i, d_pos, s_pos, has in rows_info:
            pos = d_pos if kind == "digit" else s_pos
            (p_digit if kind == "digit" else p_sum)[i] = lp[has, pos].exp()
    print("step | n | digit copy: sampled acc, mean p(right), share p<0.99 | running sum: same")
    for i, d_pos, s_pos, has in rows_info:
        n = int(has.sum())
        acc_d = (rollout.response[has, d_pos] == r_digit[i][has]).float().mean()
        acc_s = (rollout.response[has, s_pos] == r_sum[i][has]).float().mean()
        pd, ps = p_digit[i], p_sum[i]
        print(
            f"{i + 1} | {n} | {acc_d:.3f} {pd.mean():.4f} {(pd < 0.99).float().mean():.3f} | "
            f"{acc_s:.3f} {ps.mean():.4f} {(ps < 0.99).float().mean():.3f}"
        )
    filler = (rollout.response >= task.FILLER_BASE) & (rollout.response < task.NUM_BASE) & rollout.response_mask
    print(f"filler tokens: mean log p {logits_lp[filler].mean():.3f} (the data's: {-FILLER_ENTROPY:.3f})")


if __name__ == "__main__":
    main()
