"""Is a run in the paper's regime? Small per-token drift, compounded over long correct responses, starving them.

ReSPO (arXiv 2609.35433, §1) is about positive responses whose sequence weight W = π_θ/μ has drifted to log W ≪ 0
because many tokens each moved a little. A miniature in which W collapses because one or two tokens moved far
tests something else. Three checks, on the stale half of every rollout batch (mini-batches j ≥ N/2, where reuse
has moved the policy), for the positive responses (A > 0) with log W < −1 ("starved positives"):

1. they are at least :data:`MIN_STARVED_SHARE` of the positive responses;
2. fewer than :data:`MAX_TOKENS_OUTSIDE_BAND` of their tokens have a ratio π_θ/μ outside :data:`RATIO_BAND`;
3. the median share of log W carried by their most negative token, (−min_t δ_t)/(−log W), is at most
   :data:`MAX_SINGLE_TOKEN_SHARE`.

The checks are defined at N = 32 (the paper's largest reuse); they are computed and printed for every run.

A task whose wrong answers are long (``fork.py``; ``tasks.Task.high_tail``) adds a fourth check, for the paper's
other tail, the over-generated negatives: of the negative responses (A < 0) of the stale half, at least
:data:`MIN_HIGH_TAIL_SHARE` have log W > :data:`HIGH_TAIL_LOG_W` (W > e). The chain task's runs neither log its counts
nor take the check.
"""

from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass

import torch

from respo_verl.core.diagnostics import STARVATION_LOG_W as STARVED_LOG_W  # the starvation diagnostic's threshold

RATIO_BAND = (0.8, 1.25)
MIN_STARVED_SHARE = 0.15
MAX_TOKENS_OUTSIDE_BAND = 0.02
MAX_SINGLE_TOKEN_SHARE = 0.25
REGIME_REUSE = 32
PREFIX = "mini/regime/"
COUNT_KEYS = ("positives", "starved", "starved_tokens", "starved_tokens_outside_band")
# The high tail (docs/mini.md, "The second task: no verdict"; in full at commit adefddf): negatives with W > e. The
# share was fixed before any run of the second task: at 5 % of the negatives, each with W > e, they hold at least
# 5 % × e ≈ 14 % of the negatives' plain importance weight (E_μ[W] = 1), about the weight that check 1's 15 % gives
# the starved positives by count: enough for the shape of φ− above W = e to matter.
HIGH_TAIL_LOG_W = 1.0
MIN_HIGH_TAIL_SHARE = 0.05
HIGH_TAIL_KEYS = ("negatives", "negatives_high")


def update_counts(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    high_tail: bool = False,
) -> tuple[dict[str, float], list[float]]:
    """Regime counts of one mini-batch and the single-token shares of its starved positives.

    Args:
        log_prob, old_log_prob, advantages: (B, T).
        response_mask: (B, T) bool.
        high_tail: count the negatives and those with log W > HIGH_TAIL_LOG_W too (:data:`HIGH_TAIL_KEYS`).

    Returns:
        ``(counts, shares)``: counts under :data:`PREFIX` (:data:`COUNT_KEYS`, and :data:`HIGH_TAIL_KEYS` with
        ``high_tail``), and per starved positive the share of its log W carried by its most negative token.
    """
    with torch.no_grad():
        delta_tok = torch.where(response_mask, log_prob - old_log_prob, 0.0)  # (B, T)
        log_w_seq = delta_tok.sum(dim=1)  # (B,)
        n_tok_seq = response_mask.sum(dim=1)  # (B,)
        adv_seq = torch.where(response_mask, advantages, 0.0).sum(dim=1) / n_tok_seq.clamp(min=1)  # (B,)
        positive = adv_seq > 0  # (B,)
        starved = positive & (log_w_seq < STARVED_LOG_W)  # (B,)
        lo, hi = math.log(RATIO_BAND[0]), math.log(RATIO_BAND[1])
        outside_tok = response_mask & ((delta_tok < lo) | (delta_tok > hi))  # (B, T)
        most_negative = (-delta_tok).max(dim=1).values  # (B,)
        share_seq = most_negative / (-log_w_seq).clamp(min=1e-12)  # (B,)
        counts = {
            "positives": float(positive.sum()),
            "starved": float(starved.sum()),
            "starved_tokens": float(n_tok_seq[starved].sum()),
            "starved_tokens_outside_band": float(outside_tok[starved].sum()),
        }
        if high_tail:
            negative = (adv_seq < 0) & (n_tok_seq > 0)  # (B,)
            counts["negatives"] = float(negative.sum())
            counts["negatives_high"] = float((negative & (log_w_seq > HIGH_TAIL_LOG_W)).sum())
    return {PREFIX + k: v for k, v in counts.items()}, share_seq[starved].tolist()


def diffusion_high_tail(starved_share: float) -> float:
    """The share above log W = +1 that a log W which only diffuses would give at this share below −1: descriptive,
    the yardstick beside check 4
    (docs/mini.md, "The second task: no verdict").

    If log W is normal and E_μ[W] = 1, its mean is −σ²/2, and the share below −1 is Φ((σ²/2 − 1)/σ) = s. With
    z = Φ⁻¹(s) that is σ² − 2zσ − 2 = 0, so σ = z + √(z² + 2), and the share above +1 is 1 − Φ((1 + σ²/2)/σ)
    (19.8 % below gives 4.9 % above, σ = 0.8; no σ gives more than 7.9 %, at σ = √2).
    """
    if not 0.0 < starved_share < 1.0:
        raise ValueError(f"a diffusing log W gives shares below -1 in (0, 1), got {starved_share}")
    normal = statistics.NormalDist()
    z = normal.inv_cdf(starved_share)
    sigma = z + math.sqrt(z * z + 2)
    return 1 - normal.cdf((1 + sigma**2 / 2) / sigma)


class Check(enum.Enum):
    """The three regime checks (thresholds above); :attr:`label` is how the console and the docs state each."""

    STARVED = "starved_share"
    BAND = "tokens_outside_band"
    SINGLE_TOKEN = "median_single_token_share"
    HIGH_TAIL = "high_tail_share"

    @property
    def label(self) -> str:
        return {
            Check.STARVED: f"starved positives >= {MIN_STARVED_SHARE:.0%}",
            Check.BAND: f"their tokens outside [{RATIO_BAND[0]}, {RATIO_BAND[1]}] < {MAX_TOKENS_OUTSIDE_BAND:.0%}",
            Check.SINGLE_TOKEN: f"median single-token share of log W <= {MAX_SINGLE_TOKEN_SHARE:.0%}",
            Check.HIGH_TAIL: f"negatives with log W > +{HIGH_TAIL_LOG_W:g} >= {MIN_HIGH_TAIL_SHARE:.0%}",
        }[self]


@dataclass
class RegimeCheck:
    """The three regime statistics of one run (or of several pooled) and whether they hold.

    Attributes:
        reuse: N of the run(s).
        positives: positive responses in the stale half of the rollout batches.
        starved_share: starved positives / positives.
        tokens_outside_band: share of the starved positives' tokens with a ratio outside :data:`RATIO_BAND`.
        median_single_token_share: median over starved positives of their most negative token's share of log W.
        negatives, high_tail_share: the negative responses of the stale half and the share of them with
            log W > HIGH_TAIL_LOG_W; None for a task without the high-tail check (the chain task).
    """

    reuse: int
    positives: int
    starved_share: float
    tokens_outside_band: float
    median_single_token_share: float
    negatives: int | None = None
    high_tail_share: float | None = None

    @property
    def checks(self) -> dict[Check, bool]:
        out = {
            Check.STARVED: self.starved_share >= MIN_STARVED_SHARE,
            Check.BAND: self.tokens_outside_band < MAX_TOKENS_OUTSIDE_BAND,
            Check.SINGLE_TOKEN: self.median_single_token_share <= MAX_SINGLE_TOKEN_SHARE,
        }
        if self.high_tail_share is not None:
            out[Check.HIGH_TAIL] = self.high_tail_share >= MIN_HIGH_TAIL_SHARE
        return out

    @property
    def holds(self) -> bool:
        return all(self.checks.values())

    @property
    def margin(self) -> float:
        """How far the checks hold, as the smallest relative distance of a statistic from its threshold: positive
        when every check holds with room, negative when one fails (e.g. +0.1: every statistic is at least 10 % of
        its threshold on the right side of it). NaN when a statistic is."""
        room = {
            Check.STARVED: self.starved_share / MIN_STARVED_SHARE - 1,
            Check.BAND: 1 - self.tokens_outside_band / MAX_TOKENS_OUTSIDE_BAND,
            Check.SINGLE_TOKEN: 1 - self.median_single_token_share / MAX_SINGLE_TOKEN_SHARE,
        }
        if self.high_tail_share is not None:
            room[Check.HIGH_TAIL] = self.high_tail_share / MIN_HIGH_TAIL_SHARE - 1
        values = list(room.values())
        return math.nan if any(math.isnan(v) for v in values) else min(values)

    def line(self) -> str:
        """One line for the console and the docs."""
        verdict = (
            "in the regime"
            if self.holds
            else "NOT in the regime: " + "; ".join(k.label for k, ok in self.checks.items() if not ok)
        )
        tail = (
            ""
            if self.high_tail_share is None
            else f", negatives with log W > +{HIGH_TAIL_LOG_W:g} {self.high_tail_share:.1%} of {self.negatives}"
        )
        return (
            f"N = {self.reuse}: starved positives {self.starved_share:.1%} of {self.positives} positives, "
            f"their tokens outside [{RATIO_BAND[0]}, {RATIO_BAND[1]}] {self.tokens_outside_band:.2%}, median "
            f"single-token share of log W {self.median_single_token_share:.1%}{tail} -> {verdict}"
        )


def stale_totals(reuse: int, records: list[dict]) -> dict[str, float]:
    """The counts :data:`COUNT_KEYS` summed over the stale half of the rollout batches (mini-batches j ≥ N/2).

    Args:
        reuse: N.
        records: ``{"step", "data"}`` records with :data:`COUNT_KEYS` (and :data:`HIGH_TAIL_KEYS`, when logged) and
            ``mini/minibatch``.
    """
    stale = [r["data"] for r in records if r["data"]["mini/minibatch"] >= reuse // 2]
    keys = COUNT_KEYS + (HIGH_TAIL_KEYS if stale and PREFIX + HIGH_TAIL_KEYS[0] in stale[0] else ())
    return {k: sum(d[PREFIX + k] for d in stale) for k in keys}


def from_totals(reuse: int, totals: dict[str, float], shares: list[float]) -> RegimeCheck:
    """The regime statistics of stale-half counts (:func:`stale_totals`) and the starved positives' shares; the
    high tail's where the counts have it."""
    tail = {}
    if all(k in totals for k in HIGH_TAIL_KEYS):
        negatives = totals["negatives"]
        tail = {
            "negatives": int(negatives),
            "high_tail_share": totals["negatives_high"] / negatives if negatives else math.nan,
        }
    return RegimeCheck(
        reuse=reuse,
        positives=int(totals["positives"]),
        starved_share=totals["starved"] / totals["positives"] if totals["positives"] else math.nan,
        tokens_outside_band=(
            totals["starved_tokens_outside_band"] / totals["starved_tokens"] if totals["starved_tokens"] else math.nan
        ),
        median_single_token_share=statistics.median(shares) if shares else math.nan,
        **tail,
    )


def summarise(reuse: int, records: list[dict], shares: list[float]) -> RegimeCheck:
    """The regime statistics of one run's logged updates (file-logger records) and the shares it collected.

    Args:
        reuse: N.
        records: ``{"step", "data"}`` records with :data:`COUNT_KEYS` and ``mini/minibatch``.
        shares: single-token shares of the starved positives of the stale half (from :func:`update_counts`).
    """
    return from_totals(reuse, stale_totals(reuse, records), shares)


def pool(reuse: int, runs: list[tuple[dict[str, float], list[float]]]) -> RegimeCheck:
    """The regime statistics of several runs at one N taken together: their counts added, their starved positives'
    shares in one median. Each run is ``(stale_totals, shares)``."""
    if not runs:
        raise ValueError("no runs to pool")
    keys = COUNT_KEYS + (HIGH_TAIL_KEYS if all(k in t for t, _ in runs for k in HIGH_TAIL_KEYS) else ())
    totals = {k: sum(t[k] for t, _ in runs) for k in keys}
    return from_totals(reuse, totals, [x for _, shares in runs for x in shares])
