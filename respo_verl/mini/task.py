"""The verifiable task of ``respo-verl mini``: add three digits (0–4), writing every intermediate sum.

Prompt: ``<bos> d_1 … d_K =`` with K = :data:`N_DIGITS` digits. The verifier checks only the final answer: a
response is correct (reward +1) iff it ends, within the response budget, with ``# S <eos>`` where S = Σ d_i; anything
else is −1. The warm start (``model.py``) teaches two ways of answering:

- **worked** ``: [f × F  d_i  p_i] × K  # p_K <eos>`` (:data:`WORKED_LEN` tokens): K steps, each F filler tokens
  (:data:`FILLERS_PER_STEP`, from :data:`N_FILLERS`), the digit being added and the running sum p_i. The fillers
  stand for the free wording of a reasoning trace: choices that no reward depends on, but that follow the words
  before them (:func:`filler_sequence`: half of them free, half of them one of three successors of the previous
  filler), so the model has to compute every one of them from its context. Under rollout reuse each of them drifts a
  little, and over a long response the drift compounds into log W ≪ 0 (the regime of arXiv 2609.35433, §1).
- **premature** ``? <eos>`` (:func:`give_up_answer`): the model stops before doing any work, without a number.
  This is the main failure, and it is short, so correct answers are longer than wrong ones. It shares no token but
  ``<eos>`` with a worked answer, so the updates that suppress it leave the tokens of correct answers alone (a
  premature *guess* ``# g <eos>`` would share ``#`` and the numbers with them: suppressing wrong guesses then lowers
  the final answer of correct ones, docs/mini.md). :func:`premature_answer` (a guess after m < K worked steps)
  is kept for warm starts with an abort hazard.

The base model gives up in most of its responses and its arithmetic is near-certain, so it succeeds in a minority of
them (about the worked ones); RL has mainly to learn to do the work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Special tokens.
PAD, BOS, EOS, EQ, THINK, ANS, GIVE_UP = 0, 1, 2, 3, 4, 5, 6
N_FILLERS = 8
FREE_FILLER_SHARE = 0.5  # share of fillers drawn uniformly; the others follow the previous filler
FILLER_SUCCESSORS = 3  # a following filler is the previous one plus 1 .. FILLER_SUCCESSORS (mod N_FILLERS)
FILLER_BASE = 7  # fillers are FILLER_BASE .. FILLER_BASE + N_FILLERS − 1
NUM_BASE = FILLER_BASE + N_FILLERS  # number n is token NUM_BASE + n (the prompt's digits too)
# Digits per prompt and fillers per step: a worked answer of 145 tokens, 135 of them fillers, long enough that the
# per-token drift of the fillers compounds, short enough for a 2-core CPU; three steps keep the arithmetic tokens
# (the digit copies, the running sums and the answer: 7 per answer) few (docs/mini.md, "Task").
N_DIGITS = 3
MAX_DIGIT = 4  # digits 0..4: sums up to 12, an addition table the tiny model learns in a short warm start
FILLERS_PER_STEP = 45
STEP_LEN = FILLERS_PER_STEP + 2  # fillers, the digit, the running sum
MAX_SUM = MAX_DIGIT * N_DIGITS
VOCAB_SIZE = NUM_BASE + MAX_SUM + 1
PROMPT_LEN = N_DIGITS + 2  # <bos>, digits, "="
WORKED_LEN = 1 + N_DIGITS * STEP_LEN + 3  # ":", the steps, "# S <eos>"
# Room to ramble past the longest well-formed answer before the response is truncated (and scored −1).
MAX_RESPONSE_LEN = WORKED_LEN + 4
TOKEN_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", EQ: "=", THINK: ":", ANS: "#", GIVE_UP: "?"}


def num(n: int | torch.Tensor) -> int | torch.Tensor:
    """Token id of the number ``n``."""
    return n + NUM_BASE


def detokenize(ids: list[int]) -> str:
    """Readable form of a token list (for examples in docs and error messages)."""
    out = []
    for i in ids:
        if i in TOKEN_NAMES:
            out.append(TOKEN_NAMES[i])
        elif FILLER_BASE <= i < NUM_BASE:
            out.append("~" + "abcdefgh"[i - FILLER_BASE])
        else:
            out.append(str(i - NUM_BASE))
    return " ".join(out)


@dataclass
class Prompts:
    """A batch of prompts.

    Attributes:
        input_ids: (P, PROMPT_LEN).
        attention_mask: (P, PROMPT_LEN) 1 on real tokens (all of them: prompts have one length).
        digits: (P, N_DIGITS).
        answer: (P,) the sum.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    digits: torch.Tensor
    answer: torch.Tensor

    def repeat_interleave(self, n: int) -> Prompts:
        """Each prompt n times in a row (verl's rollout.n layout: a prompt's group is contiguous)."""
        return Prompts(
            *(t.repeat_interleave(n, dim=0) for t in (self.input_ids, self.attention_mask, self.digits, self.answer))
        )


def sample_prompts(n: int, generator: torch.Generator) -> Prompts:
    """``n`` prompts of N_DIGITS digits ~ U{0..MAX_DIGIT}."""
    digits = torch.randint(0, MAX_DIGIT + 1, (n, N_DIGITS), generator=generator)  # (P, K)
    input_ids = torch.cat([torch.full((n, 1), BOS), num(digits), torch.full((n, 1), EQ)], dim=1)  # (P, PROMPT_LEN)
    return Prompts(input_ids, torch.ones_like(input_ids), digits, digits.sum(dim=1))


def filler_sequence(n: int, generator: torch.Generator) -> list[int]:
    """``n`` filler ids (0-based): each is free (uniform over the N_FILLERS) with probability FREE_FILLER_SHARE,
    otherwise the previous filler plus 1, 2 or 3 (mod N_FILLERS); the first follows filler 0.

    Every filler has probability at least FREE_FILLER_SHARE / N_FILLERS given the previous one (1/16), so no filler
    of a sampled answer is a near-impossible token whose log-probability the updates could move far.
    """
    moves = torch.randint(1, FILLER_SUCCESSORS + 1, (n,), generator=generator)  # (n,)
    free = torch.rand(n, generator=generator) < FREE_FILLER_SHARE  # (n,)
    anything = torch.randint(0, N_FILLERS, (n,), generator=generator)  # (n,)
    out, previous = [], 0
    for move, is_free, choice in zip(moves.tolist(), free.tolist(), anything.tolist(), strict=True):
        previous = choice if is_free else (previous + move) % N_FILLERS
        out.append(previous)
    return out


def worked_steps(digits: list[int], n_steps: int, generator: torch.Generator) -> list[int]:
    """``:`` and the first ``n_steps`` worked steps for ``digits``, with fillers from :func:`filler_sequence`."""
    out, running = [THINK], 0
    fillers = filler_sequence(n_steps * FILLERS_PER_STEP, generator)
    for i in range(n_steps):
        running += digits[i]
        out += [FILLER_BASE + f for f in fillers[i * FILLERS_PER_STEP : (i + 1) * FILLERS_PER_STEP]]
        out += [int(num(digits[i])), int(num(running))]
    return out


def worked_answer(digits: list[int], generator: torch.Generator) -> list[int]:
    """A correct worked response for ``digits``."""
    return [*worked_steps(digits, len(digits), generator), ANS, int(num(sum(digits))), EOS]


def give_up_answer() -> list[int]:
    """The premature answer of the default warm start: ``? <eos>``, no work and no number (always wrong)."""
    return [GIVE_UP, EOS]


def premature_answer(digits: list[int], n_steps: int, generator: torch.Generator) -> list[int]:
    """A guess ``# g <eos>`` (g uniform) after ``n_steps`` < K worked steps (none: a direct guess)."""
    guess = int(torch.randint(0, MAX_SUM + 1, (1,), generator=generator))
    head = worked_steps(digits, n_steps, generator) if n_steps > 0 else []
    return [*head, ANS, int(num(guess)), EOS]


def response_lengths(response: torch.Tensor) -> torch.Tensor:
    """(B,) tokens up to and including the first EOS, or the full length when there is none (truncated)."""
    is_eos = response == EOS  # (B, T)
    return torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, response.shape[1])  # (B,)


def verify(response: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Reward ±1 per response: +1 iff it ends (EOS within the budget) with ``# S <eos>``, S the true sum.

    Args:
        response: (B, T) sampled tokens (anything after the first EOS is ignored).
        answer: (B,) true sums.

    Returns:
        (B,) float rewards in {−1, +1}.
    """
    lengths = response_lengths(response)  # (B,)
    ended = (response == EOS).any(dim=1)  # (B,)
    rows = torch.arange(response.shape[0])
    ans_marker = response[rows, (lengths - 3).clamp(min=0)]  # (B,) the token two before <eos>
    final = response[rows, (lengths - 2).clamp(min=0)]  # (B,) the token right before <eos>
    correct = ended & (lengths >= 3) & (ans_marker == ANS) & (final == num(answer))  # (B,)
    return torch.where(correct, 1.0, -1.0)


def completed_steps(response: torch.Tensor) -> torch.Tensor:
    """(B,) worked steps written before the answer marker (0 for a direct guess), from the response's length."""
    lengths = response_lengths(response)  # (B,)
    worked = response[:, 0] == THINK  # (B,)
    return torch.where(worked, ((lengths - 4).clamp(min=0) // STEP_LEN).clamp(max=N_DIGITS), 0)
