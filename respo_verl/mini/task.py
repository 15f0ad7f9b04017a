"""The verifiable task of ``respo-verl mini``: add a few digits, optionally thinking aloud first.

Prompt: ``<bos> d_1 … d_k =`` with k ∈ [K_MIN, K_MAX] digits. The verifier checks only the final answer: a response
is correct (reward +1) iff it ends with ``# S <eos>`` where S = Σ d_i, within the response budget; anything else is
−1. Two ways of answering exist, and the warm start (``model.py``) teaches both:

- **direct** ``# S' <eos>`` (3 tokens): the base model has only seen guesses here, so it is right about once in
  ``MAX_SUM + 1`` tries. The short wrong answer is the common failure.
- **thinking** ``: [~]* p_1 [~]* p_2 … [~]* p_k # S <eos>`` (≈ 2k + 4 tokens): the running sums p_i, each preceded by
  0–2 free filler tokens ``~a … ~d``. Working it out this way is how the answer can be right, so correct responses
  are longer than wrong ones; the fillers are the "style" tokens of a real reasoning trace — free choices of high
  entropy that the policy drifts on under reuse, which is what sends long responses to log W ≪ 0 (SPEC §1).

The base model thinks aloud in a minority of its answers and its running sums are not yet reliable, so it succeeds
rarely; RL has to learn to think aloud and to add correctly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Special tokens.
PAD, BOS, EOS, EQ, THINK, ANS = 0, 1, 2, 3, 4, 5
N_FILLERS = 4
FILLER_BASE = 6  # fillers are FILLER_BASE .. FILLER_BASE + N_FILLERS − 1
NUM_BASE = FILLER_BASE + N_FILLERS  # number n is token NUM_BASE + n (digits of the prompt too)
K_MIN, K_MAX = 3, 6  # digits per prompt: enough steps for long answers, few enough for a tiny model
MAX_SUM = 9 * K_MAX
VOCAB_SIZE = NUM_BASE + MAX_SUM + 1
MAX_FILLERS_PER_STEP = 2
PROMPT_LEN = K_MAX + 2  # <bos>, K_MAX digits (left-padded), "="
# Longest thinking answer (":" + K_MAX·(fillers + sum) + "# S <eos>") plus room to ramble before truncation.
LONGEST_ANSWER = 1 + K_MAX * (MAX_FILLERS_PER_STEP + 1) + 3
MAX_RESPONSE_LEN = LONGEST_ANSWER + 2
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
            out.append("~" + "abcd"[i - FILLER_BASE])
        else:
            out.append(str(i - NUM_BASE))
    return " ".join(out)


@dataclass
class Prompts:
    """A batch of prompts.

    Attributes:
        input_ids: (P, PROMPT_LEN) left-padded with PAD.
        attention_mask: (P, PROMPT_LEN) 1 on real tokens.
        digits: (P, K_MAX) the digits, −1 beyond k.
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
    """``n`` prompts with k ~ U{K_MIN..K_MAX} and digits ~ U{0..9}."""
    k = torch.randint(K_MIN, K_MAX + 1, (n,), generator=generator)  # (P,)
    digits = torch.randint(0, 10, (n, K_MAX), generator=generator)  # (P, K_MAX)
    valid = torch.arange(K_MAX).unsqueeze(0) < k.unsqueeze(1)  # (P, K_MAX)
    digits = torch.where(valid, digits, -1)
    answer = torch.where(valid, digits, 0).sum(dim=1)  # (P,)
    input_ids = torch.full((n, PROMPT_LEN), PAD, dtype=torch.long)
    attention_mask = torch.zeros((n, PROMPT_LEN), dtype=torch.long)
    for i in range(n):
        ki = int(k[i])
        row = [BOS, *(int(num(d)) for d in digits[i, :ki]), EQ]
        input_ids[i, PROMPT_LEN - len(row) :] = torch.tensor(row)
        attention_mask[i, PROMPT_LEN - len(row) :] = 1
    return Prompts(input_ids, attention_mask, digits, answer)


def thinking_answer(digits: list[int], generator: torch.Generator) -> list[int]:
    """A correct thinking-aloud response for ``digits`` with random fillers."""
    out, running = [THINK], 0
    for d in digits:
        n_fill = int(torch.randint(0, MAX_FILLERS_PER_STEP + 1, (1,), generator=generator))
        out += [FILLER_BASE + int(f) for f in torch.randint(0, N_FILLERS, (n_fill,), generator=generator)]
        running += d
        out.append(int(num(running)))
    return [*out, ANS, int(num(running)), EOS]


def direct_guess(generator: torch.Generator) -> list[int]:
    """A direct answer with a uniformly guessed sum: what the base model has seen of direct answers."""
    return [ANS, int(num(int(torch.randint(0, MAX_SUM + 1, (1,), generator=generator)))), EOS]


def response_lengths(response: torch.Tensor) -> torch.Tensor:
    """(B,) tokens up to and including the first EOS, or the full length when there is none (truncated)."""
    is_eos = response == EOS  # (B, T)
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, response.shape[1])  # (B,)
    return first


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


def uses_thinking(response: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the response starts by thinking aloud."""
    return response[:, 0] == THINK
