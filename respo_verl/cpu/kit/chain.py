"""The kit's regime task: write a long chain of steps, each a free choice among a few words, without losing one's place.

This is the task on which rollout reuse starves long correct answers (arXiv 2609.35433, §1), sized for verl's trainer
on a CPU: the answer to every prompt is

    ``:``  w_1  w_2  …  w_S  ``#``  ``</s>``        (S = :data:`STEPS` steps)

where w_k is any of the :data:`WORDS_PER_STEP` words of step k (written ``<k>.<letter>``, e.g. ``7.c``). No reward
depends on which word, so the policy keeps every word of a step at a moderate probability; each update moves them a
little, and over a long answer the moves add up: a correct answer sampled before several updates has log W well
below 0. The prompt (:data:`PROMPT_DIGITS` digits) only tells problems apart.

An answer ends at ``</s>`` or at its first token out of the grammar (:func:`breaks_grammar`): the rollout server's
stop rule :func:`ends_answer` (``actor_rollout_ref.rollout.custom.stop_rule``) ends it there, as an agent ends an
episode at an invalid action. The reward is +1 for the complete chain and −1 for anything else, so a wrong answer is
one that broke off: the base model either gives up (``?``) or slips (a word of another step).

Token ids follow from :func:`vocabulary` alone, so the stop rule needs no tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DATA_SOURCE = "respo_verl/cpu_chain"
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
THINK, ANSWER, GIVE_UP, PROMPT_SUFFIX = ":", "#", "?", "="
PROMPT_DIGITS, MAX_DIGIT = 3, 4
STEPS = 48
WORDS_PER_STEP = 4
LETTERS = "abcdefgh"
COMPLETE = "complete"  # the ground truth of every prompt: the answer must be a complete chain
# ":", the words, "#" and "</s>"; the grammar allows nothing after it.
MAX_RESPONSE_TOKENS = STEPS + 3
MAX_PROMPT_TOKENS = PROMPT_DIGITS + 2  # "<s>", the digits, "="


def word(step: int, choice: int) -> str:
    """Word ``choice`` (0-based) of step ``step`` (0-based), e.g. ``word(6, 2) == "7.c"``."""
    return f"{step + 1}.{LETTERS[choice]}"


def vocabulary() -> dict[str, int]:
    """Token -> id: the special tokens, the digits, the punctuation, then the words step by step."""
    tokens = [*SPECIAL_TOKENS, *(str(d) for d in range(MAX_DIGIT + 1)), PROMPT_SUFFIX, THINK, ANSWER, GIVE_UP]
    tokens += [word(step, choice) for step in range(STEPS) for choice in range(WORDS_PER_STEP)]
    return {token: i for i, token in enumerate(tokens)}


_VOCAB = vocabulary()
_FIRST_WORD = _VOCAB[word(0, 0)]


def _allowed(position: int) -> range:
    """Ids allowed at response position ``position`` (0-based): ``:``, a word of each step in turn, ``#``, ``</s>``."""
    if position == 0:
        return range(_VOCAB[THINK], _VOCAB[THINK] + 1)
    if position <= STEPS:
        first = _FIRST_WORD + (position - 1) * WORDS_PER_STEP
        return range(first, first + WORDS_PER_STEP)
    if position == STEPS + 1:
        return range(_VOCAB[ANSWER], _VOCAB[ANSWER] + 1)
    if position == STEPS + 2:
        return range(_VOCAB[EOS], _VOCAB[EOS] + 1)
    return range(0)


def breaks_grammar(position: int, token: int) -> bool:
    """Whether ``token`` at response position ``position`` is outside the grammar."""
    return token not in _allowed(position)


def ends_answer(position: int, token: int) -> bool:
    """The rollout server's stop rule: the answer ends with this token (kept), at ``</s>`` or at the first token
    out of the grammar."""
    return token == _VOCAB[EOS] or breaks_grammar(position, token)


@dataclass(frozen=True)
class Problem:
    digits: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return " ".join(str(d) for d in self.digits)

    @property
    def answer(self) -> str:
        return COMPLETE


def problems(count: int, seed: int) -> list[Problem]:
    """``count`` prompts of :data:`PROMPT_DIGITS` digits drawn uniformly (deterministic in ``seed``)."""
    rng = random.Random(seed)
    return [Problem(tuple(rng.randint(0, MAX_DIGIT) for _ in range(PROMPT_DIGITS))) for _ in range(count)]


def complete_chain(rng: random.Random) -> list[str]:
    """A complete answer (without ``</s>``), each word uniform among its step's."""
    return [THINK, *(word(step, rng.randrange(WORDS_PER_STEP)) for step in range(STEPS)), ANSWER]


def broken_chain(rng: random.Random) -> list[str]:
    """An answer that breaks off at a uniform step: it gives up (``?``) or slips to a word of another step."""
    step = rng.randrange(STEPS)
    head = complete_chain(rng)[: 1 + step]
    if rng.random() < 0.5:
        return [*head, GIVE_UP]
    other = rng.choice([s for s in range(STEPS) if s != step])
    return [*head, word(other, rng.randrange(WORDS_PER_STEP))]


def warm_start_pairs(count: int, seed: int, complete_share: float) -> list[tuple[str, str, bool]]:
    """Supervised examples ``(prompt, response, ends_with_eos)``: ``complete_share`` of them complete chains, the rest
    chains that break off (which end at the breaking token, as the stop rule ends them)."""
    rng = random.Random(seed)
    pairs = []
    for problem in problems(count, seed + 1):
        if rng.random() < complete_share:
            pairs.append((problem.prompt, " ".join(complete_chain(rng)), True))
        else:
            pairs.append((problem.prompt, " ".join(broken_chain(rng)), False))
    return pairs


def score(solution: str, ground_truth: str) -> float:
    """+1.0 when ``solution`` (the decoded answer, special tokens skipped) is the complete chain, else -1.0."""
    if ground_truth != COMPLETE:
        raise ValueError(f"the chain task's ground truth is {COMPLETE!r}, got {ground_truth!r}")
    tokens = solution.split()
    if len(tokens) != STEPS + 2 or tokens[0] != THINK or tokens[-1] != ANSWER:
        return -1.0
    for step, token in enumerate(tokens[1:-1]):
        if token not in {word(step, choice) for choice in range(WORDS_PER_STEP)}:
            return -1.0
    return 1.0


def build_tokenizer():
    """One token per whitespace-separated word (``tokenizers`` WordLevel) with a chat template, as a fast HF
    tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK))
    # Split at spaces only: any other text (verl's agent loop probes a newline) is one unknown token, not nothing.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(" +"), behavior="removed")
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    template = (
        "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
        "{% if add_generation_prompt %} " + PROMPT_SUFFIX + "{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=template,
        model_max_length=MAX_PROMPT_TOKENS + MAX_RESPONSE_TOKENS,
    )
