"""Where the drift of log W sits in a run of the miniature: per token kind and per part of the chain.

Runs one configuration through ``experiments.mini.train.train`` from the default base model (shipped with the
package) and, for the starved positives (A > 0, log W < −1) of the stale half of every rollout batch (mini-batches
j ≥ N/2, as the regime checks), counts per token kind (``:``, the words of the steps, ``#``, ``<eos>``) and per tenth
of the chain's steps: its share of their tokens, of their tokens outside [0.8, 1.25], of their most negative tokens,
and of their negative drift Σ max(−δ, 0). Positives are complete chains, so a token's kind and step follow from its
position. Prints the run's regime line too.

For the starved positives whose most negative token is not a word, it also prints that token's probability
under μ, under π_θ just before the update of its own mini-batch (what the loss sees), and just after that update
(a forward of the updated policy, without gradient): whether the token drifted away slowly or swings from one
update to the next. Last, how far the run moved each weight matrix: ‖θ_end − θ_base‖ / ‖θ_base‖.

Usage: python experiments/mini/probes/drift_probe.py [--lr 3e-4] [--reuse 32] [--steps 128] [--seed 0] [--warm-seed 0]
[--algo respo]
[--warm-steps S]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections import Counter

import torch

from experiments.mini import model as model_lib
from experiments.mini import regime, task
from experiments.mini.rollout import response_log_prob
from experiments.mini.train import RunConfig, UpdateEvent, train

PARTS = 10  # the chain's steps in tenths
KINDS = (
    "words",
    ":",
    "#",
    "<eos>",
    *(f"words, steps {p * task.N_STEPS // PARTS + 1}-{(p + 1) * task.N_STEPS // PARTS}" for p in range(PARTS)),
)


def kind(t: int) -> str:
    """Kind of response position ``t`` of a complete chain."""
    if 1 <= t <= task.N_STEPS:
        return KINDS[0]
    return {0: KINDS[1], task.N_STEPS + 1: KINDS[2], task.N_STEPS + 2: KINDS[3]}[t]


def part(t: int) -> str:
    """The tenth of the chain that the word at response position ``t`` belongs to."""
    return KINDS[4 + (t - 1) * PARTS // task.N_STEPS]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--reuse", type=int, default=32)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-seed", type=int, default=0)
    parser.add_argument("--algo", default="respo")
    parser.add_argument("--warm-steps", type=int, default=None, help="warm-start steps (default: the recipe's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    steps = {} if args.warm_steps is None else {"steps": args.warm_steps}
    base, origin = model_lib.warm_start(model_lib.ModelSpec(), model_lib.WarmStart(seed=args.warm_seed, **steps))
    print(f"base model: {origin}")
    base_weights = {k: v.clone() for k, v in base.state_dict().items()}
    policy = []  # the run's policy (the same module after every update)
    tokens, outside, most_negative, drift = Counter(), Counter(), Counter(), Counter()  # per kind and per tenth
    pending, positive_log_w, shares_by_kind = [], [], {}
    own_update = []  # (μ, π before its update, π after it) of the most negative tokens that are not words
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
        positive_log_w.extend(delta[adv > 0].sum(dim=1).tolist())
        not_words = []  # (row, position) of the starved positives whose most negative token is not a word
        for i in torch.nonzero((adv > 0) & (delta.sum(dim=1) < regime.STARVED_LOG_W)).flatten().tolist():
            d = delta[i, : int(n_tok[i])].tolist()
            worst = min(range(len(d)), key=d.__getitem__)
            labels = [kind(worst)] + ([part(worst)] if kind(worst) == KINDS[0] else [])
            for label in labels:
                most_negative[label] += 1
                shares_by_kind.setdefault(label, []).append(-d[worst] / -sum(d))
            for t, x in enumerate(d):
                for label in [kind(t)] + ([part(t)] if kind(t) == KINDS[0] else []):
                    tokens[label] += 1
                    outside[label] += x < lo or x > hi
                    drift[label] += max(-x, 0.0)
            if kind(worst) != KINDS[0]:
                not_words.append((i, worst))
        if not_words:
            rows = torch.tensor([i for i, _ in not_words])
            was_training = event.policy.training
            event.policy.eval()
            with torch.no_grad():
                after = response_log_prob(event.policy, event.rollout.rows(rows))  # (k, T)
            event.policy.train(was_training)
            for r, (i, t) in enumerate(not_words):
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
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
    quantiles = torch.quantile(torch.tensor(positive_log_w), q).tolist()
    print(
        f"log W of the positives ({len(positive_log_w)}), quantiles 5/25/50/75/95 %: "
        + " ".join(f"{v:+.3f}" for v in quantiles)
    )
    print(
        "median single-token share by the kind of the most negative token: "
        + ", ".join(f"{k} {torch.tensor(v).median():.2f} ({len(v)})" for k, v in shares_by_kind.items())
    )
    if own_update:
        mu, before, after = torch.tensor(own_update).T
        print(
            f"most negative token not a word ({len(own_update)}): median probability under mu {mu.median():.3f}, "
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
    print(f"starved positives counted: {sum(most_negative[k] for k in KINDS[:4])}")
    print(
        "| token kind | share of their tokens | share of their tokens outside the band | most negative token | "
        "share of the negative drift |"
    )
    for k in KINDS:
        print(
            f"| {k} | {tokens[k] / max(1, sum(tokens[k] for k in KINDS[:4])):.0%} | "
            f"{outside[k] / max(1, tokens[k]):.2%} | {most_negative[k]} | "
            f"{drift[k] / max(1e-12, sum(drift[k] for k in KINDS[:4])):.0%} |"
        )


if __name__ == "__main__":
    main()
