"""The miniature's second task, ``fork``: know when to stop, and make no mistake on the way. Both of the paper's
tails exist on it. :class:`Fork` is the task for a number of words per segment; :data:`FORK` (30 words) is the task
``fork``. Three later versions (``fork_long``, ``fork_stop``, ``fork_extra``) gave no verdict and live in the history
(docs/mini.md, "The second task: no verdict").

Prompt: the chain task's ``<bos> d_1 d_2 d_3 =`` (``task.py``). Its digit sum sets how many segments the answer
needs, :func:`segments_needed`: from 2 for the easiest prompts to :data:`N_SEGMENTS` for the hardest. A response is

    ``:``  w_1 … w_S  f_1  w_(S+1) … w_2S  f_2  …                  (S = ``Fork.SEGMENT_STEPS`` words per segment)

where w_s is one of the :data:`WORDS_PER_STEP` words of step s (every step its own words, as in the chain task:
free wording, no reward depends on which) or a **mistake**: a word of any other step, which the grammar allows and
the verifier does not (:meth:`Fork.is_mistake`); and f_i, the **fork** after segment i, is ``+`` (go on) or ``<eos>``
(stop). After the last segment only ``<eos>`` is allowed. The forks are the answer's few reward-relevant decisions:
the verifier gives +1 iff the answer is grammatical, has no mistake and stops at the fork of the prompt's segment
count k; −1 otherwise. So a hard prompt needs a long correct answer (k = 5: 156 tokens at S = 30) and an easy one a
short one (k = 2: 63 tokens).

The response ends at ``<eos>`` or at its first token that breaks the grammar (:meth:`Fork.breaks_grammar`): a word where
``:`` or a fork belongs, ``<eos>`` inside a segment, a digit. A mistake does not end it: a word out of place is
wrong, and the answer goes on (docs/mini.md at commit adefddf says why the grammar changed to this). The warm
start's data (:meth:`Fork.warm_start_answer`) make the base model err in three ways:

- it makes a **mistake** (:attr:`Ending.MISTAKE`) and goes on: the long wrong mode, as long as a correct answer
  and like one in every other token, so that what the updates do to the correct answers they do to it. Its
  mistakes are spread over thousands of (position, word) pairs, each sampled rarely, so that RL unlearns them
  slowly, as the chain task's slips;
- it **goes on** (:attr:`Ending.OVERSHOT`): ``+`` at the fork where it should stop, and then on to the last segment;
- it **slips**: a word of a step of another segment, where the data answer is cut off. Under the grammar a slip is
  one more mistake, and a sampled answer goes on after it.

docs/mini.md, "The second task: no verdict", has the measurements.
"""

from __future__ import annotations

import enum

import torch

# The prompts are the chain task's, held-out problems included (``task.held_out_problems``).
from experiments.mini.task import (
    BOS,
    DIGIT_BASE,
    EOS,
    EQ,
    MAX_DIGIT,
    N_DIGITS,
    N_HELD_OUT,
    N_PROBLEMS,
    PAD,
    PROMPT_LEN,
    THINK,
    Prompts,
    digit,
    held_out_problems,
    problem_digits,
    prompts_of,
    render_tokens,
    sample_prompts,
    sample_training_prompts,
)

__all__ = [
    "BOS",
    "EOS",
    "EQ",
    "N_DIGITS",
    "N_HELD_OUT",
    "N_PROBLEMS",
    "PAD",
    "PROMPT_LEN",
    "Prompts",
    "digit",
    "held_out_problems",
    "problem_digits",
    "prompts_of",
    "sample_prompts",
    "sample_training_prompts",
]

GO = 5  # the fork token "+": go on to the next segment (the chain task's "#" id; this task has no "#")
N_SEGMENTS = 5
MIN_SEGMENTS = 2
WORDS_PER_STEP = 4
WORD_BASE = DIGIT_BASE + MAX_DIGIT + 1  # word v of step s (0-based) is WORD_BASE + s·WORDS_PER_STEP + v
# Digit-sum thresholds of the segment counts: a sum of at most 3 needs 2 segments, 4–5 three, 6–7 four, 8–12 five
# (with three digits 0–4: 16 %, 26 %, 30 % and 28 % of the prompts).
SEGMENT_SUMS = (3, 5, 7)
TOKEN_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", EQ: "=", THINK: ":", GO: "+"}

# The warm start's data: at the fork where an answer should stop it goes on with probability OVERSHOOT_SHARE (and
# then to the last segment); at every step it makes a mistake with probability MISTAKE_HAZARD (a uniform word of
# another step of the segment, and goes on) and slips with probability SLIP_HAZARD (a word of a step of another
# segment, where the data answer is cut off). With these, a third of the base model's answers are right and
# most wrong ones are long (docs/mini.md, "The second task: no verdict").
OVERSHOOT_SHARE = 0.1
MISTAKE_HAZARD = 0.004
SLIP_HAZARD = 0.002
# The warm start's steps (model.WarmStart.steps): half the chain task's 3000, which the chain task's regime also
# held with (docs/mini.md at commit adefddf, on how the chain task got here), so that a fresh warm start takes
# minutes, not a quarter hour.
WARM_START_STEPS = 1500


def word(step: int | torch.Tensor, v: int | torch.Tensor) -> int | torch.Tensor:
    """Token id of word ``v`` of step ``step`` (both 0-based; v < WORDS_PER_STEP)."""
    return WORD_BASE + step * WORDS_PER_STEP + v


def segments_needed(digits: torch.Tensor) -> torch.Tensor:
    """(P,) segments the correct answer has, for prompts with these (P, N_DIGITS) digits."""
    total = digits.sum(dim=1)  # (P,)
    return MIN_SEGMENTS + sum((total > t).long() for t in SEGMENT_SUMS)


def detokenize(ids: list[int]) -> str:
    """Readable form: words as ``<step>.<letter>`` (1-based steps), e.g. ``: 1.c 2.a … 30.d + 31.b``."""
    return render_tokens(ids, TOKEN_NAMES, WORD_BASE, WORDS_PER_STEP)


class Ending(enum.IntEnum):
    """How a response ended (the values :meth:`Fork.ending` returns)."""

    COMPLETE = 0
    MISTAKE = 1  # a mistake was written (however the response ended afterwards)
    OVERSHOT = 2  # no mistake, went on at the fork where it should have stopped (however it ended afterwards)
    STOPPED_EARLY = 3  # ``<eos>`` at an earlier fork
    SLIPPED = 4  # a word where ``:`` or a fork belongs
    OTHER = 5  # any other token out of place


# The endings the run logs as mini/<name>_frac (train.rollout_metrics).
ENDING_METRICS = {
    "mistake": Ending.MISTAKE,
    "overshot": Ending.OVERSHOT,
    "slipped": Ending.SLIPPED,
    "stopped_early": Ending.STOPPED_EARLY,
}


class Fork:
    """The task with ``segment_steps`` words per segment: its grammar, verifier, endings and warm-start data.

    An instance is the task's module for ``tasks.Task.module`` (the interface ``tasks.py`` names): the prompt
    functions and special tokens of the chain task, and the constants and functions below.

    Attributes:
        name: the task's registry name (``tasks.NAMES``), which starts its runs' names and enters its recipe.
        SEGMENT_STEPS: words per segment; N_STEPS, SEGMENT_LEN, MAX_RESPONSE_LEN, VOCAB_SIZE follow from it.
    """

    PAD, BOS, EOS, PROMPT_LEN = PAD, BOS, EOS, PROMPT_LEN
    Ending = Ending
    sample_prompts = staticmethod(sample_prompts)
    sample_training_prompts = staticmethod(sample_training_prompts)
    prompts_of = staticmethod(prompts_of)
    problem_digits = staticmethod(problem_digits)
    held_out_problems = staticmethod(held_out_problems)

    def __init__(self, name: str, segment_steps: int) -> None:
        if segment_steps < 2:
            raise ValueError(
                f"a segment needs at least 2 words (a mistake is a word of another step), got {segment_steps}"
            )
        self.name = name
        self.SEGMENT_STEPS = segment_steps
        self.N_STEPS = N_SEGMENTS * segment_steps
        self.SEGMENT_LEN = segment_steps + 1  # its words and the fork after them
        self.MAX_RESPONSE_LEN = 1 + N_SEGMENTS * self.SEGMENT_LEN  # ":", then every segment
        self.VOCAB_SIZE = WORD_BASE + self.N_STEPS * WORDS_PER_STEP
        self._lo, self._hi, self._own_lo, self._own_hi, self._fork = self._allowed()
        self._last_fork = self.fork_position(N_SEGMENTS)

    def __repr__(self) -> str:
        return f"Fork({self.name!r}, segment_steps={self.SEGMENT_STEPS})"

    def fork_position(self, segment: int | torch.Tensor) -> int | torch.Tensor:
        """Response position (0-based) of the fork after segment ``segment`` (1-based)."""
        return segment * self.SEGMENT_LEN

    def position_of_step(self, step: int) -> int:
        """Response position (0-based) of the word of step ``step`` (0-based): after ``:`` and the forks before it."""
        return 1 + step + step // self.SEGMENT_STEPS

    def _allowed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(MAX_RESPONSE_LEN,) ×5: the words the grammar allows at each position as a range [lo, hi) (the words of
        every step at a word's place; empty at ``:`` and the forks), the position's own step's words as a range
        [own_lo, own_hi), and whether the position is a fork."""
        lo, hi, own_lo, own_hi = (torch.zeros(self.MAX_RESPONSE_LEN, dtype=torch.long) for _ in range(4))
        is_fork = torch.zeros(self.MAX_RESPONSE_LEN, dtype=torch.bool)
        for s in range(self.N_STEPS):
            position = self.position_of_step(s)
            lo[position], hi[position] = word(0, 0), word(self.N_STEPS, 0)
            own_lo[position], own_hi[position] = word(s, 0), word(s + 1, 0)
        for i in range(1, N_SEGMENTS + 1):
            is_fork[self.fork_position(i)] = True
        return lo, hi, own_lo, own_hi, is_fork

    def _in_grammar(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Whether ``tokens`` are allowed at response positions ``position`` (same shapes, < MAX_RESPONSE_LEN)."""
        word_ok = (tokens >= self._lo[position]) & (tokens < self._hi[position])
        fork_ok = self._fork[position] & ((tokens == EOS) | ((tokens == GO) & (position != self._last_fork)))
        think_ok = (position == 0) & (tokens == THINK)
        return word_ok | fork_ok | think_ok

    def is_mistake(self, tokens: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """Whether ``tokens`` at response positions ``position`` are mistakes: at a word's place, words of any other
        step (bool, same shape as ``tokens``)."""
        position = torch.as_tensor(position).clamp(max=self.MAX_RESPONSE_LEN - 1).expand_as(tokens)
        a_word = (tokens >= self._lo[position]) & (tokens < self._hi[position])
        return a_word & ~((tokens >= self._own_lo[position]) & (tokens < self._own_hi[position]))

    def breaks_grammar(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Whether ``tokens``, at response position ``position`` (0-based), are outside the grammar (bool, same shape).

        Position 0 must be ``:``; then every word's place a word (of any step: a word of another step is a mistake,
        not a break); each fork ``+`` or ``<eos>``, the last fork ``<eos>`` only; nothing may follow. The sampler
        ends a response at such a token (``rollout.sample``)."""
        if position >= self.MAX_RESPONSE_LEN:
            return torch.ones_like(tokens, dtype=torch.bool)
        return ~self._in_grammar(tokens, torch.full_like(tokens, position))

    def response_lengths(self, response: torch.Tensor) -> torch.Tensor:
        """(B,) tokens up to and including the first ``<eos>`` or the first token that breaks the grammar (the
        sampler stopped there), or the full width when there is neither."""
        width = response.shape[1]
        position = torch.arange(width).clamp(max=self.MAX_RESPONSE_LEN - 1).expand_as(response)  # (B, T)
        ends = ~self._in_grammar(response, position) | (response == EOS)  # (B, T)
        if width > self.MAX_RESPONSE_LEN:
            ends[:, self.MAX_RESPONSE_LEN :] = True
        return torch.where(ends.any(dim=1), ends.int().argmax(dim=1) + 1, width)  # (B,)

    def _last_tokens(self, response: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) ×2: each response's length and its last token."""
        lengths = self.response_lengths(response)  # (B,)
        return lengths, response[torch.arange(response.shape[0]), lengths - 1]

    def stopped_at(self, response: torch.Tensor) -> torch.Tensor:
        """(B,) the segment after which the response stopped with ``<eos>`` at a fork, 0 if it did not stop so."""
        lengths, last = self._last_tokens(response)  # (B,), (B,)
        at_fork = (last == EOS) & (lengths % self.SEGMENT_LEN == 1) & (lengths > 1)  # forks at i·SEGMENT_LEN
        return torch.where(at_fork, (lengths - 1) // self.SEGMENT_LEN, 0)

    def verify(self, response: torch.Tensor, prompts: Prompts) -> torch.Tensor:
        """Reward ±1 per response: +1 iff it is grammatical, has no mistake and stops at the fork after the
        prompt's segment count.

        Args:
            response: (B, T) sampled tokens, T ≥ MAX_RESPONSE_LEN (anything after the end is ignored).
            prompts: the B prompts (one row per response).

        Returns:
            (B,) float rewards in {−1, +1}.
        """
        if response.shape[1] < self.MAX_RESPONSE_LEN:
            raise ValueError(
                f"verify needs responses at least {self.MAX_RESPONSE_LEN} tokens wide, got width {response.shape[1]}"
            )
        if prompts.digits.shape[0] != response.shape[0]:
            raise ValueError(f"verify got {response.shape[0]} responses but {prompts.digits.shape[0]} prompts")
        right = self.stopped_at(response) == segments_needed(prompts.digits)  # (B,)
        return torch.where(right & ~self._has_mistake(response), 1.0, -1.0)

    def _has_mistake(self, response: torch.Tensor) -> torch.Tensor:
        """(B,) whether a mistake was written before the response ended."""
        width = response.shape[1]
        inside = torch.arange(width).unsqueeze(0) < self.response_lengths(response).unsqueeze(1)  # (B, T)
        return (self.is_mistake(response, torch.arange(width)) & inside).any(dim=1)

    def steps_written(self, response: torch.Tensor) -> torch.Tensor:
        """(B,) words written before the response ended."""
        lengths, last = self._last_tokens(response)  # (B,), (B,)
        written = lengths - 1 - (lengths - 1) // self.SEGMENT_LEN  # positions after ":" that are not forks
        position = (lengths - 1).clamp(max=self.MAX_RESPONSE_LEN - 1)
        last_was_word = (position % self.SEGMENT_LEN != 0) & (position > 0)
        bad_word = last_was_word & ~self._in_grammar(last, position)  # a non-word in a word's place ended it
        return (written - bad_word.long()).clamp(min=0, max=self.N_STEPS)

    def ending(self, response: torch.Tensor, prompts: Prompts) -> torch.Tensor:
        """(B,) how each response ended, an :class:`Ending` value per row."""
        lengths, last = self._last_tokens(response)  # (B,), (B,)
        needed = segments_needed(prompts.digits)  # (B,)
        stop = self.stopped_at(response)  # (B,)
        rows = torch.arange(response.shape[0])
        position = self.fork_position(needed)  # (B,)
        went_on = (lengths > position) & (response[rows, position.clamp(max=response.shape[1] - 1)] == GO)
        went_on &= needed < N_SEGMENTS  # "+" at the last fork breaks the grammar
        slipped = last >= WORD_BASE
        out = torch.where(slipped, Ending.SLIPPED, Ending.OTHER)
        out = torch.where((stop > 0) & (stop < needed), Ending.STOPPED_EARLY, out)
        out = torch.where(went_on, Ending.OVERSHOT, out)
        out = torch.where(self._has_mistake(response), Ending.MISTAKE, out)
        return torch.where((stop == needed) & (out != Ending.MISTAKE), Ending.COMPLETE, out)

    def answer(self, needed: int, segments: int, generator: torch.Generator) -> list[int]:
        """A grammatical answer without mistakes of ``segments`` segments that stops after them, each word uniform
        among its step's; right iff ``segments == needed``."""
        if not 1 <= segments <= N_SEGMENTS:
            raise ValueError(f"an answer has 1 to {N_SEGMENTS} segments, got {segments}")
        steps = self.SEGMENT_STEPS
        choice = torch.randint(0, WORDS_PER_STEP, (segments * steps,), generator=generator).tolist()
        out = [THINK]
        for i in range(segments):
            out += [int(word(s, choice[s])) for s in range(i * steps, (i + 1) * steps)]
            out.append(EOS if i == segments - 1 else GO)
        return out

    def warm_start_answer(self, needed: int, generator: torch.Generator) -> list[int]:
        """One answer of the warm start's data for a prompt that needs ``needed`` segments: it goes on past that fork
        to the last segment with probability :data:`OVERSHOOT_SHARE` (where there is a next segment); at each step it
        makes a mistake with probability :data:`MISTAKE_HAZARD` (a uniform word of another step of the segment) and
        goes on, and it slips with probability :data:`SLIP_HAZARD` (a uniform word of a step of another segment,
        where the answer is cut off: the data have no word after a slip)."""
        seg = self.SEGMENT_STEPS
        segments = needed
        if needed < N_SEGMENTS and float(torch.rand((), generator=generator)) < OVERSHOOT_SHARE:
            segments = N_SEGMENTS
        full = self.answer(needed, segments, generator)
        steps = (len(full) - 1) // self.SEGMENT_LEN * seg
        draw = torch.rand(steps, generator=generator)  # (steps,)
        for s in (draw < MISTAKE_HAZARD).nonzero().squeeze(1).tolist():
            other = int(torch.randint(0, seg - 1, (1,), generator=generator))
            other += other >= s % seg
            v = int(torch.randint(0, WORDS_PER_STEP, (1,), generator=generator))
            full[self.position_of_step(s)] = int(word(s - s % seg + other, v))
        slips = (draw >= MISTAKE_HAZARD) & (draw < MISTAKE_HAZARD + SLIP_HAZARD)  # (steps,)
        if not bool(slips.any()):
            return full
        step = int(slips.int().argmax())
        first = step - step % seg  # the slip's step lies outside the segment [first, first + seg)
        other = int(torch.randint(0, self.N_STEPS - seg, (1,), generator=generator))
        other += seg * (other >= first)
        v = int(torch.randint(0, WORDS_PER_STEP, (1,), generator=generator))
        return [*full[: self.position_of_step(step)], int(word(other, v))]

    def warm_start_answers(self, prompts: Prompts, generator: torch.Generator) -> list[list[int]]:
        """The warm start's answers (:meth:`warm_start_answer`) to a batch of prompts, one per row."""
        return [self.warm_start_answer(int(k), generator) for k in segments_needed(prompts.digits)]

    def recipe(self) -> dict:
        """What of the task determines its base model (part of ``model.recipe_key``)."""
        return {
            "name": self.name,
            "segments": [MIN_SEGMENTS, N_SEGMENTS, self.SEGMENT_STEPS, WORDS_PER_STEP, *SEGMENT_SUMS],
            "data": [OVERSHOOT_SHARE, MISTAKE_HAZARD, SLIP_HAZARD],
            "vocab": self.VOCAB_SIZE,
        }


# The second task (version E, docs/mini.md, "The second task: no verdict"): 30 words per segment, 156 tokens at most.
FORK = Fork("fork", 30)
NAME = FORK.name
