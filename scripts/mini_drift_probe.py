"""Where the drift of log W sits in a `respo-verl mini` run: per token kind of the starved positives.

Runs one configuration through ``respo_verl.mini.train.train`` from the default base model (shipped with the
package) and, for the
starved positives (A > 0, log W < −1) of the stale half of every rollout batch (mini-batches j ≥ N/2, as the regime
checks), counts per token kind (fillers, digit copies, running sums, ``:``, ``#``, ``S``, ``<eos>``): its share of their
tokens, of their tokens outside [0.8, 1.25], of their most negative tokens, and of their negative drift
Σ max(−δ, 0). Positives are well-formed (they end with ``# S <eos>``), so a token's kind follows from its position
and the answer's length. Prints the run's regime line too.

For the starved positives whose most negative token is not a filler, it also prints that token's probability
under μ, under π_θ just before the update of its own mini-batch (what the loss sees), and just after that update
(a forward of the updated policy, without gradient): whether the token drifted away slowly or swings from one
update to the next. Last, how far the run moved each weight matrix: ‖θ_end − θ_base‖ / ‖θ_base‖.

Usage: python scripts/mini_drift_probe.py [--lr 1e-4] [--reuse 32] [--steps 128] [--seed 0] [--warm-seed 0]
[--algo respo]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections import Counter

import torch

from respo_verl.mini import model as model_lib
from respo_verl.mini import regime, task
from respo_verl.mini.rollout import response_log_prob
from respo_verl.mini.train import RunConfig, UpdateEvent, train

KINDS = ("fillers", "digit copies", "running sums", ":", "#", "S", "<eos>")


def kind(t: int, n: int) -> str:
    if t >= n - 3:  # a direct guess (n = 3) is only these
        return KINDS[4 + t - (n - 3)]
    if t == 0:
        return KINDS[3]
    k = (t - 1) % task.STEP_LEN
    return KINDS[0] if k < task.FILLERS_PER_STEP else KINDS[1] if k == task.FILLERS_PER_STEP else KINDS[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--reuse", type=int, default=32)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-seed", type=int, default=0)
    parser.add_argument("--algo", default="respo")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    base, origin = model_lib.warm_start(model_lib.ModelSpec(), model_lib.WarmStart(seed=args.warm_seed))
    print(f"base model: {origin}")
    base_weights = {k: v.clone() for k, v in base.state_dict().items()}
    policy = []  # the run's policy (the same module after every update)
    tokens, outside, most_negative, drift, lengths = Counter(), Counter(), Counter(), Counter(), Counter()
    pending, positive_sums, shares_by_kind = [], [], {}
    own_update = []  # (μ, π before its update, π after it) of the most negative non-filler tokens
    real = regime.update_counts
    lo, hi = math.log(regime.RATIO_BAND[0]), math.log(regime.RATIO_BAND[1])

    def spy(log_prob, old_log_prob, advantages, response_mask):
        pending.append((log_prob, old_log_prob, advantages, response_mask))
        return real(log_prob, old_log_prob, advantages, response_mask)

    def on_update(event: UpdateEvent) -> None:
        policy[:] = [event.policy]
        log_prob, old_log_prob, advantages, mask = pending.pop()
        if event.minibatch < args.reuse // 2:
            return
        delta = torch.where(mask, log_prob - old_log_prob, 0.0)  # (b, T)
        n_tok = mask.sum(dim=1)
        adv = torch.where(mask, advantages, 0.0).sum(dim=1) / n_tok.clamp(min=1)
        for i in torch.nonzero(adv > 0).flatten().tolist():
            n = int(n_tok[i])
            is_filler = torch.tensor([kind(t, n) == KINDS[0] for t in range(n)])
            positive_sums.append((float(delta[i, :n][is_filler].sum()), float(delta[i, :n][~is_filler].sum())))
        arithmetic = []  # (row, position) of the starved positives whose most negative token is not a filler
        for i in torch.nonzero((adv > 0) & (delta.sum(dim=1) < regime.STARVED_LOG_W)).flatten().tolist():
            n = int(n_tok[i])
            lengths[n] += 1
            d = delta[i, :n].tolist()
            worst = min(range(n), key=d.__getitem__)
            most_negative[kind(worst, n)] += 1
            shares_by_kind.setdefault(kind(worst, n), []).append(-d[worst] / -sum(d))
            for t, x in enumerate(d):
                k = kind(t, n)
                tokens[k] += 1
                outside[k] += x < lo or x > hi
                drift[k] += max(-x, 0.0)
            if kind(worst, n) != KINDS[0]:
                arithmetic.append((i, worst))
        if arithmetic:
            rows = torch.tensor([i for i, _ in arithmetic])
            was_training = event.policy.training
            event.policy.eval()
            with torch.no_grad():
                after = response_log_prob(event.policy, event.rollout.rows(rows))  # (k, T)
            event.policy.train(was_training)
            for r, (i, t) in enumerate(arithmetic):
                probs = (old_log_prob[i, t].exp(), log_prob[i, t].exp(), after[r, t].exp())
                own_update.append(tuple(float(p) for p in probs))

    regime.update_counts = spy
    try:
        cfg = RunConfig(
            args.algo, args.reuse, args.seed, args.steps, 4 * args.reuse, 8, args.lr, warm_seed=args.warm_seed
        )
        with tempfile.TemporaryDirectory() as tmp:
            result = train(cfg, base, tmp, on_update=on_update)
    finally:
        regime.update_counts = real
    print(f"{cfg.name}: {result.regime.line()} ({result.wall_s:.0f} s)")
    quarter = [r["data"] for r in result.records[-max(1, len(result.records) // 4) :]]
    correct = [d["mini/response_length/correct_mean"] for d in quarter]
    wrong = [d["mini/response_length/wrong_mean"] for d in quarter]
    correct = [v for v in correct if not math.isnan(v)]
    wrong = [v for v in wrong if not math.isnan(v)]
    print(
        f"first rollout batch score {result.records[0]['data']['mini/score']:.1%}; last quarter correct/wrong length "
        f"{sum(correct) / len(correct):.1f} / {sum(wrong) / len(wrong):.1f}"
    )
    fill, rest = torch.tensor(positive_sums).T
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
    print(f"log W of the positives ({len(positive_sums)}), quantiles 5/25/50/75/95 %:")
    for name, x in (("fillers", fill), ("other tokens", rest), ("all", fill + rest)):
        print(f"  {name}: " + " ".join(f"{v:+.3f}" for v in torch.quantile(x, q).tolist()))
    print(
        "median single-token share by the kind of the most negative token: "
        + ", ".join(f"{k} {torch.tensor(v).median():.2f} ({len(v)})" for k, v in shares_by_kind.items())
    )
    if own_update:
        mu, before, after = torch.tensor(own_update).T
        print(
            f"most negative token not a filler ({len(own_update)}): median probability under mu {mu.median():.3f}, "
            f"before its own update {before.median():.3f}, after it {after.median():.3f}; after it at least 0.5 in "
            f"{int((after >= 0.5).sum())}, lower than before in {int((after < before).sum())}"
        )
    moved = {
        k: float((v - base_weights[k]).norm() / base_weights[k].norm())
        for k, v in policy[0].state_dict().items()
        if v.dim() == 2
    }
    widest = max(moved, key=moved.get)
    print(
        f"weight matrices moved by {min(moved.values()):.1%} to {max(moved.values()):.1%} of their norm over the run "
        f"(most: {widest})"
    )
    starved, direct = sum(most_negative.values()), lengths[3]
    print(f"starved positives counted: {starved}, of which direct guesses (3 tokens): {direct}")
    print(
        "| token kind | share of their tokens | share of their tokens outside the band | most negative token | "
        "share of the negative drift |"
    )
    for k in KINDS:
        print(
            f"| {k} | {tokens[k] / max(1, sum(tokens.values())):.0%} | "
            f"{outside[k] / max(1, tokens[k]):.2%} | {most_negative[k]} | "
            f"{drift[k] / max(1e-12, sum(drift.values())):.0%} |"
        )


if __name__ == "__main__":
    main()
