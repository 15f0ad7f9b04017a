"""The miniature's verifiable task: write a long chain of steps without losing one's place.

Prompt: ``<bos> d_1 … d_K =`` with K = :data:`N_DIGITS` digits 0–:data:`MAX_DIGIT` (a problem; its digits set how
hard it is for the base model, ``model.py``). A response has a fixed grammar:

    ``:``  w_1  w_2  …  w_S  ``#``  ``<eos>``        (S = :data:`N_STEPS` steps, :data:`WORKED_LEN` tokens)

where w_k is one of the :data:`WORDS_PER_STEP` words of step k (:func:`word`). The words stand for the free wording
of a reasoning trace: any word of the step is right and no reward depends on which, so every one of them is sampled
with a moderate probability and under rollout reuse each drifts a little; over a long answer the drift compounds
into log W ≪ 0 (the regime of arXiv 2609.35433, §1). Every step has its own words, so the model knows where it is
from the word before, without counting.

The response ends at ``<eos>`` or at its first token that breaks the grammar (:func:`breaks_grammar`): the sampler
stops there, as an agent loop ends an episode at an invalid action. The verifier gives +1 to the complete chain
and −1 to everything else, so every wrong answer is a premature one, as long as the steps written before it broke
off. The base model breaks off in two ways (the warm start's data): it **gives up** (``?`` instead of the next word)
or it **slips** (writes a word of another step: it lost its place). RL suppresses the give-ups within a rollout batch
or two; the slips are spread over hundreds of words and recede slowly, so the task keeps something to learn through
a run and its wrong answers stay short (docs/mini.md, "The task").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

# Special tokens.
PAD, BOS, EOS, EQ, THINK, ANS, GIVE_UP = 0, 1, 2, 3, 4, 5, 6
N_DIGITS = 3
MAX_DIGIT = 4
DIGIT_BASE = 7  # digit d is token DIGIT_BASE + d
N_STEPS = 140
WORDS_PER_STEP = 4
WORD_BASE = DIGIT_BASE + MAX_DIGIT + 1  # word v of step k (0-based) is WORD_BASE + k·WORDS_PER_STEP + v
VOCAB_SIZE = WORD_BASE + N_STEPS * WORDS_PER_STEP
PROMPT_LEN = N_DIGITS + 2  # <bos>, digits, "="
WORKED_LEN = N_STEPS + 3  # ":", the words, "# <eos>"
# Nothing follows a complete chain: a response is never longer than one.
MAX_RESPONSE_LEN = WORKED_LEN
TOKEN_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", EQ: "=", THINK: ":", ANS: "#", GIVE_UP: "?"}


def digit(d: int | torch.Tensor) -> int | torch.Tensor:
    """Token id of the prompt digit ``d``."""
    return d + DIGIT_BASE


def word(step: int | torch.Tensor, v: int | torch.Tensor) -> int | torch.Tensor:
    """Token id of word ``v`` of step ``step`` (both 0-based)."""
    return WORD_BASE + step * WORDS_PER_STEP + v


def detokenize(ids: list[int]) -> str:
    """Readable form of a token list: words as ``<step>.<letter>`` (1-based steps), e.g. ``: 1.c 2.a #``."""
    return render_tokens(ids, TOKEN_NAMES, WORD_BASE, WORDS_PER_STEP)


def render_tokens(ids: list[int], names: dict[int, str], word_base: int, words_per_step: int) -> str:
    """Named tokens by ``names``, words (ids from ``word_base``) as ``<step>.<letter>``, the rest as prompt digits."""
    out = []
    for i in ids:
        if i in names:
            out.append(names[i])
        elif i >= word_base:
            step, v = divmod(i - word_base, words_per_step)
            out.append(f"{step + 1}.{'abcdefgh'[v]}")
        else:
            out.append(str(i - DIGIT_BASE))
    return " ".join(out)


@dataclass
class Prompts:
    """A batch of prompts.

    Attributes:
        input_ids: (P, PROMPT_LEN).
        attention_mask: (P, PROMPT_LEN) 1 on real tokens (all of them: prompts have one length).
        digits: (P, N_DIGITS).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    digits: torch.Tensor

    def rows(self, index: slice | torch.Tensor) -> Prompts:
        return Prompts(self.input_ids[index], self.attention_mask[index], self.digits[index])

    def repeat_interleave(self, n: int) -> Prompts:
        """Each prompt n times in a row (verl's rollout.n layout: a prompt's group is contiguous)."""
        return Prompts(*(t.repeat_interleave(n, dim=0) for t in (self.input_ids, self.attention_mask, self.digits)))


def sample_prompts(n: int, generator: torch.Generator) -> Prompts:
    """``n`` prompts of N_DIGITS digits ~ U{0..MAX_DIGIT}."""
    return prompts_of(torch.randint(0, MAX_DIGIT + 1, (n, N_DIGITS), generator=generator))


def prompts_of(digits: torch.Tensor) -> Prompts:
    """The prompts of given problems, (P, N_DIGITS) digits."""
    n = digits.shape[0]
    input_ids = torch.cat([torch.full((n, 1), BOS), digit(digits), torch.full((n, 1), EQ)], dim=1)  # (P, PROMPT_LEN)
    return Prompts(input_ids, torch.ones_like(input_ids), digits)


N_PROBLEMS = (MAX_DIGIT + 1) ** N_DIGITS
N_HELD_OUT = N_PROBLEMS // 5
HELD_OUT_SEED = 2609


def problem_digits(ids: torch.Tensor) -> torch.Tensor:
    """(P,) problem ids in [0, N_PROBLEMS) → (P, N_DIGITS) digits (the id written in base MAX_DIGIT + 1)."""
    base = MAX_DIGIT + 1
    powers = base ** torch.arange(N_DIGITS - 1, -1, -1)  # (K,)
    return ids.unsqueeze(1) // powers % base


def held_out_problems() -> torch.Tensor:
    """The ids of the :data:`N_HELD_OUT` problems a held-out run never trains on, one fixed draw for every run."""
    return torch.randperm(N_PROBLEMS, generator=torch.Generator().manual_seed(HELD_OUT_SEED))[:N_HELD_OUT].sort().values


def sample_training_prompts(n: int, generator: torch.Generator) -> Prompts:
    """``n`` prompts drawn uniformly from the problems outside :func:`held_out_problems`."""
    seen = torch.ones(N_PROBLEMS, dtype=torch.bool)
    seen[held_out_problems()] = False
    ids = seen.nonzero().squeeze(1)  # (N_PROBLEMS − N_HELD_OUT,)
    return prompts_of(problem_digits(ids[torch.randint(0, ids.numel(), (n,), generator=generator)]))


def _allowed() -> tuple[torch.Tensor, torch.Tensor]:
    """(WORKED_LEN,) ×2: the tokens allowed at each response position, as a range [lo, hi)."""
    lo = torch.tensor([THINK, *(word(k, 0) for k in range(N_STEPS)), ANS, EOS])
    return lo, lo + torch.tensor([1, *[WORDS_PER_STEP] * N_STEPS, 1, 1])


_LO, _HI = _allowed()


def breaks_grammar(tokens: torch.Tensor, position: int) -> torch.Tensor:
    """Whether ``tokens``, at response position ``position`` (0-based), are outside the grammar (bool, same shape).

    Position 0 must be ``:``, position k (1 ≤ k ≤ N_STEPS) a word of step k, then ``#`` and ``<eos>``; nothing may
    follow. The sampler ends a response at such a token (``rollout.sample``)."""
    if position >= WORKED_LEN:
        return torch.ones_like(tokens, dtype=torch.bool)
    return (tokens < _LO[position]) | (tokens >= _HI[position])


def response_lengths(response: torch.Tensor) -> torch.Tensor:
    """(B,) tokens up to and including the first ``<eos>`` or the first token that breaks the grammar (the sampler
    stopped there), or the full width when there is neither."""
    width = response.shape[1]
    lo, hi = _LO[:width], _HI[:width]  # (T,)
    ends = (response < lo) | (response >= hi) | (response == EOS)  # (B, T)
    if width > WORKED_LEN:
        ends[:, WORKED_LEN:] = True
    return torch.where(ends.any(dim=1), ends.int().argmax(dim=1) + 1, width)  # (B,)


def verify(response: torch.Tensor) -> torch.Tensor:
    """Reward ±1 per response: +1 iff it is the complete chain ``: w_1 … w_S # <eos>``.

    Args:
        response: (B, T) sampled tokens, T ≥ WORKED_LEN (anything after the end is ignored).

    Returns:
        (B,) float rewards in {−1, +1}.
    """
    if response.shape[1] < WORKED_LEN:
        raise ValueError(f"verify needs responses at least {WORKED_LEN} tokens wide, got width {response.shape[1]}")
    head = response[:, :WORKED_LEN]  # (B, WORKED_LEN)
    complete = ((head >= _LO) & (head < _HI)).all(dim=1)  # (B,): the last position allows only <eos>
    return torch.where(complete, 1.0, -1.0)


def steps_written(response: torch.Tensor) -> torch.Tensor:
    """(B,) words of the chain written before the response ended (N_STEPS for a complete one)."""
    lengths = response_lengths(response)  # (B,)
    return (lengths - 2).clamp(min=0, max=N_STEPS)


class Ending(enum.IntEnum):
    """How a response ended (the values :func:`ending` returns)."""

    COMPLETE = 0
    GAVE_UP = 1  # ``?``
    SLIPPED = 2  # a word of another step
    OTHER = 3  # any other token out of place


def ending(response: torch.Tensor) -> torch.Tensor:
    """(B,) how each response ended, an :class:`Ending` value per row."""
    lengths = response_lengths(response)  # (B,)
    last = response[torch.arange(response.shape[0]), lengths - 1]  # (B,)
    complete = verify(response) > 0
    broken = torch.where(
        last == GIVE_UP, Ending.GAVE_UP, torch.where(last >= WORD_BASE, Ending.SLIPPED, Ending.OTHER)
    )  # (B,)
    return torch.where(complete, Ending.COMPLETE, broken)


def worked_answer(generator: torch.Generator) -> list[int]:
    """A complete chain, each word uniform among its step's words."""
    choice = torch.randint(0, WORDS_PER_STEP, (N_STEPS,), generator=generator)  # (S,)
    return [THINK, *(int(word(k, v)) for k, v in enumerate(choice.tolist())), ANS, EOS]


def broken_answer(step: int, give_up: bool, generator: torch.Generator) -> list[int]:
    """A chain that breaks off at ``step`` (0-based: the steps before it are written): ``?`` when ``give_up``, else a
    slip to a uniform word of another step."""
    head = worked_answer(generator)[: 1 + step]
    if give_up:
        return [*head, GIVE_UP]
    other = int(torch.randint(0, N_STEPS - 1, (1,), generator=generator))
    other += other >= step
    return [*head, int(word(other, int(torch.randint(0, WORDS_PER_STEP, (1,), generator=generator))))]
