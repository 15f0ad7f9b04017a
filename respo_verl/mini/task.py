"""The verifiable task of ``respo-verl mini``: add eight digits (0–4), writing every intermediate sum.

Prompt: ``<bos> d_1 … d_K =`` with K = :data:`N_DIGITS` digits. The verifier checks only the final answer: a
response is correct (reward +1) iff it ends, within the response budget, with ``# S <eos>`` where S = Σ d_i; anything
else is −1. The warm start (``model.py``) teaches two ways of answering:

- **worked** ``: [f × F  d_i  p_i] × K  # p_K <eos>`` (:data:`WORKED_LEN` tokens): K steps, each F free filler tokens
  (:data:`FILLERS_PER_STEP`, any of :data:`N_FILLERS`), the digit being added and the running sum p_i. The fillers
  stand for the free wording of a reasoning trace: high-entropy choices that no reward depends on, so under rollout
  reuse each of them drifts a little, and over a long response the drift compounds into log W ≪ 0 (the regime of
  arXiv 2609.35433, §1) without any single token moving far.
- **premature** ``# g <eos>`` straight away, or after m < K worked steps (``: [step] × m # g <eos>``): the answer is
  guessed before the work is done. This is the main failure, and it is short, so correct answers are longer than
  wrong ones.

The base model answers prematurely in most of its responses and its arithmetic is near-certain, so it succeeds in a
minority of them (about the worked ones); RL has mainly to learn to finish the work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Special tokens.
PAD, BOS, EOS, EQ, THINK, ANS = 0, 1, 2, 3, 4, 5
N_FILLERS = 8
FILLER_BASE = 6  # fillers are FILLER_BASE .. FILLER_BASE + N_FILLERS − 1
NUM_BASE = FILLER_BASE + N_FILLERS  # number n is token NUM_BASE + n (the prompt's digits too)
# Digits per prompt and fillers per step: a worked answer of 84 tokens, long enough that the per-token drift of the
# fillers compounds, short enough for a 2-core CPU.
N_DIGITS = 8
MAX_DIGIT = 4  # digits 0..4: sums up to 32, an addition table the tiny model learns in a short warm start
FILLERS_PER_STEP = 8
STEP_LEN = FILLERS_PER_STEP + 2  # fillers, the digit, the running sum
MAX_SUM = MAX_DIGIT * N_DIGITS
VOCAB_SIZE = NUM_BASE + MAX_SUM + 1
PROMPT_LEN = N_DIGITS + 2  # <bos>, digits, "="
WORKED_LEN = 1 + N_DIGITS * STEP_LEN + 3  # ":", the steps, "# S <eos>"
# Room to ramble past the longest well-formed answer before the response is truncated (and scored −1).
MAX_RESPONSE_LEN = WORKED_LEN + 4
TOKEN_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", EQ: "=", THINK: ":", ANS: "#"}


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


def worked_steps(digits: list[int], n_steps: int, generator: torch.Generator) -> list[int]:
    """``:`` and the first ``n_steps`` worked steps for ``digits``, with random fillers."""
    out, running = [THINK], 0
    fillers = torch.randint(0, N_FILLERS, (n_steps, FILLERS_PER_STEP), generator=generator)  # (m, F)
    for i in range(n_steps):
        running += digits[i]
        out += [FILLER_BASE + int(f) for f in fillers[i]]
        out += [int(num(digits[i])), int(num(running))]
    return out


def worked_answer(digits: list[int], generator: torch.Generator) -> list[int]:
    """A correct worked response for ``digits``."""
    return [*worked_steps(digits, len(digits), generator), ANS, int(num(sum(digits))), EOS]


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
