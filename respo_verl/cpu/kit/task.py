"""The kit's task: two-number addition answered in a math-answer format (``#### <sum>``).

A prompt is ``"17+25"``; the chat template appends ``"="``; a correct response is ``"#### 42"`` followed by the end
of sequence. The reward is +1 for the right final answer and -1 otherwise (the ReSPO paper's ±1 outcome reward), so
verl's ``critic/score/mean`` is a reward in [-1, 1].
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

DATA_SOURCE = "respo_verl/cpu_addition"
ANSWER_MARK = "####"
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Every character a prompt or a response can hold; the tokenizer is one token per character.
CHARACTERS = tuple("0123456789+=# -")
PROMPT_SUFFIX = "="
# A response is at most "#### -198" and the end of sequence; a little headroom lets the policy ramble and fail.
MAX_RESPONSE_TOKENS = 12
MAX_PROMPT_TOKENS = 8
# Operand range: small enough that the tiny model learns part of the table in its warm start, not all of it.
OPERAND_LOW, OPERAND_HIGH = 0, 29
_ANSWER = re.compile(r"####\s*(-?\d+)")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}"

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def response(self) -> str:
        """The correct response text (without the end-of-sequence token)."""
        return f"{ANSWER_MARK} {self.answer}"


def problems(count: int, seed: int, low: int = OPERAND_LOW, high: int = OPERAND_HIGH) -> list[Problem]:
    """``count`` problems with operands drawn uniformly from ``[low, high]`` (deterministic in ``seed``)."""
    rng = random.Random(seed)
    return [Problem(rng.randint(low, high), rng.randint(low, high)) for _ in range(count)]


def extract_answer(solution: str) -> str | None:
    """The last ``#### <integer>`` of ``solution``, or None when there is none."""
    found = _ANSWER.findall(solution)
    return found[-1] if found else None


def score(solution: str, ground_truth: str) -> float:
    """+1.0 when the final answer equals ``ground_truth``, else -1.0."""
    return 1.0 if extract_answer(solution) == str(ground_truth).strip() else -1.0
