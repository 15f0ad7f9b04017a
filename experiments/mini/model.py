"""The tiny policy (a ``transformers`` Qwen3 or Qwen3-MoE built from a config) and its cached warm start.

The "base model" of the experiment is the tiny model after a brief supervised warm start on a mixture of complete
chains and chains that break off (``task.py``). It is deterministic for a given
specification, seed and machine. The repository ships the base models of the default recipe (:data:`SHIPPED_DIR`, both
warm seeds), so every machine starts RL from the same weights; any other recipe is trained once and cached under
``~/.cache/respo_verl/mini/<key>.pt`` (key = hash of everything that determines it).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from experiments.mini import task, tasks
from experiments.mini.rollout import Rollout, response_log_prob
from respo_verl.cpu.kit.model import CACHE_ROOT, build_tiny_qwen3

DEFAULT_CACHE_DIR = CACHE_ROOT.expanduser() / "mini"
# The base models of the default recipe (warm seeds 0 and 1), trained by `warm_start` on the project's machine and
# shipped with the package, so that every machine starts RL from the same weights and no run pays for a warm start
# (docs/mini.md, "Base models"). `python -m experiments.mini --train-base` trains them afresh instead.
SHIPPED_DIR = Path(__file__).parent / "base_models"
# Bumped whenever the task or the warm-start recipe changes, so that stale cached base models are not reused.
WARM_START_VERSION = 8


@dataclass(frozen=True)
class ModelSpec:
    """Size of the tiny model. The defaults run a rollout batch and 32 updates in about a second on one CPU core.

    Attributes:
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: the Qwen3 shape.
        moe: build ``Qwen3MoeForCausalLM`` (every layer sparse) instead of the dense model.
        num_experts, experts_per_token, moe_intermediate_size: the MoE shape (top-k routing, normalised top-k).
    """

    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    moe: bool = False
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 96


@dataclass(frozen=True)
class WarmStart:
    """The supervised warm start that makes the base model.

    Its data are complete chains and chains that break off (``task.broken_answer``): at every step a chain breaks
    off with a per-step hazard, half of the time by giving up (``?``), half of the time by a slip (a word of another
    step). The hazard is set so that ``base_success`` of the data is complete for a prompt of average difficulty,
    and each prompt scales it by 2^(difficulty · (Σ digits − 6) / 3) (:func:`hazard`). Another task (``fork.py``)
    makes its own data (``tasks.Task.warm_start_answers``): of this recipe it uses ``steps``, ``batch_size``, ``lr``
    and ``seed``; ``base_success``, ``give_up_share`` and ``difficulty`` are the chain task's data knobs.

    Attributes:
        steps: optimizer steps.
        batch_size: examples per step.
        lr: peak AdamW learning rate (linear warm-up over the first 5 % of the steps, then linear decay to 0).
        base_success: share of complete chains in the data at average difficulty; aims the base model's success
            at 20–40 % (docs/mini.md).
        give_up_share: share of the broken chains that give up (the rest slip).
        difficulty: how much the prompt's digit sum scales the hazard (0: every prompt alike).
        seed: initialisation and data seed (the experiment's warm-start seed).
    """

    steps: int = 3000
    batch_size: int = 64
    lr: float = 3e-3
    base_success: float = 0.3
    give_up_share: float = 0.5
    difficulty: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.base_success < 1.0:
            raise ValueError(f"WarmStart.base_success must lie strictly between 0 and 1, got {self.base_success}")
        if not 0.0 <= self.give_up_share <= 1.0:
            raise ValueError(f"WarmStart.give_up_share must lie in [0, 1], got {self.give_up_share}")
        if self.difficulty < 0 or self.steps < 0 or self.batch_size < 1:
            raise ValueError(
                f"WarmStart needs difficulty >= 0, steps >= 0 and batch_size >= 1, got {self.difficulty}, "
                f"{self.steps}, {self.batch_size}"
            )


def hazard(digits: torch.Tensor, warm: WarmStart) -> torch.Tensor:
    """(P,) per-step chance that a chain of the warm-start data breaks off, for prompts with these digits (P, K)."""
    average = 1.0 - warm.base_success ** (1.0 / task.N_STEPS)
    centre = task.N_DIGITS * task.MAX_DIGIT / 2
    scale = 2.0 ** (warm.difficulty * (digits.sum(dim=1).double() - centre) / 3)  # (P,)
    return (1.0 - (1.0 - average) ** scale).float()


def build_model(spec: ModelSpec, seed: int, task_name: str = tasks.DEFAULT) -> torch.nn.Module:
    """A freshly initialised tiny causal LM in fp32 on CPU (the package's tiny-Qwen3 factory), sized for the task
    ``task_name`` (``tasks.TASKS``: its vocabulary and longest prompt and response)."""
    grammar = tasks.get(task_name).module
    model = build_tiny_qwen3(
        spec,
        vocab_size=grammar.VOCAB_SIZE,
        seed=seed,
        max_position_embeddings=grammar.PROMPT_LEN + grammar.MAX_RESPONSE_LEN,
        tie_word_embeddings=True,
        pad_token_id=task.PAD,
        bos_token_id=task.BOS,
        eos_token_id=task.EOS,
    )
    return model.eval()


def recipe_key(spec: ModelSpec, warm: WarmStart, task_name: str = tasks.DEFAULT) -> str:
    """Hash of the recipe of the base model: the model, the warm start and the task (not the machine).

    The chain task's key is the one its shipped base models carry; another task's adds its own recipe
    (``tasks.Task.recipe``)."""
    recipe = {
        "spec": asdict(spec),
        "warm": asdict(warm),
        "version": WARM_START_VERSION,
        "vocab": task.VOCAB_SIZE,
        "task": [task.N_DIGITS, task.MAX_DIGIT, task.N_STEPS, task.WORDS_PER_STEP],
    }
    own = tasks.get(task_name).recipe
    if own is not None:
        recipe["task"] = own
        del recipe["vocab"]  # in the task's own recipe
    payload = json.dumps(recipe, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cache_key(spec: ModelSpec, warm: WarmStart, task_name: str = tasks.DEFAULT) -> str:
    """Hash of everything that determines a base model trained here: the recipe and the torch version."""
    payload = json.dumps({"recipe": recipe_key(spec, warm, task_name), "torch": torch.__version__.split("+")[0]})
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def shipped_path(spec: ModelSpec, warm: WarmStart, task_name: str = tasks.DEFAULT) -> Path:
    """Where the package keeps the base model of this recipe, when it ships one (:data:`SHIPPED_DIR`)."""
    return SHIPPED_DIR / f"{recipe_key(spec, warm, task_name)}.pt"


def _sft_batch(warm: WarmStart, generator: torch.Generator, task_name: str = tasks.DEFAULT) -> Rollout:
    """A batch of warm-start data: for the chain task complete chains and chains that break off
    (:class:`WarmStart`); for another task its own answers (``tasks.Task.warm_start_answers``)."""
    answers = tasks.get(task_name).warm_start_answers
    if answers is not None:
        grammar = tasks.get(task_name).module
        prompts = grammar.sample_prompts(warm.batch_size, generator)
        response = torch.full((warm.batch_size, grammar.MAX_RESPONSE_LEN), grammar.PAD, dtype=torch.long)
        for i, row in enumerate(answers(prompts, generator)):
            response[i, : len(row)] = torch.tensor(row)
        lengths = grammar.response_lengths(response)  # (N,)
        return Rollout(prompts, response, torch.arange(grammar.MAX_RESPONSE_LEN).unsqueeze(0) < lengths.unsqueeze(1))
    prompts = task.sample_prompts(warm.batch_size, generator)
    breaks = torch.rand(warm.batch_size, task.N_STEPS, generator=generator) < hazard(prompts.digits, warm)[:, None]
    give_up = torch.rand(warm.batch_size, generator=generator) < warm.give_up_share  # (N,)
    response = torch.full((warm.batch_size, task.MAX_RESPONSE_LEN), task.PAD, dtype=torch.long)
    for i in range(warm.batch_size):
        if bool(breaks[i].any()):
            row = task.broken_answer(int(breaks[i].int().argmax()), bool(give_up[i]), generator)
        else:
            row = task.worked_answer(generator)
        response[i, : len(row)] = torch.tensor(row)
    mask = torch.arange(task.MAX_RESPONSE_LEN).unsqueeze(0) < task.response_lengths(response).unsqueeze(1)
    return Rollout(prompts, response, mask)


def log_likelihood(model: torch.nn.Module, batch: Rollout, buckets: int = 4) -> torch.Tensor:
    """Σ log π over the response tokens of ``batch``, with the rows sorted by length into ``buckets`` forwards.

    The rows of a warm-start batch have every length from 2 to WORKED_LEN tokens: each bucket is cut to its own
    longest row, so short rows do not pay for the longest. With causal attention and right padding, the tokens after
    a response never reach it, so this is the log-likelihood of the whole padded batch (tested;
    docs/mini.md, "Base models").
    """
    lengths = batch.response_mask.sum(dim=1)  # (N,)
    total = torch.zeros(())
    for rows in torch.argsort(lengths).chunk(buckets):
        n = int(lengths[rows].max())
        group = batch.rows(rows)
        group = Rollout(group.prompts, group.response[:, :n], group.response_mask[:, :n])
        total = total + torch.where(group.response_mask, response_log_prob(model, group), 0.0).sum()
    return total


def warm_start(
    spec: ModelSpec,
    warm: WarmStart,
    cache_dir: Path | None = DEFAULT_CACHE_DIR,
    on_step: Callable[[int], None] | None = None,
    shipped: bool = True,
    task_name: str = tasks.DEFAULT,
) -> tuple[torch.nn.Module, str]:
    """The base model: the package's copy of it, or the cached one, or trained (minutes) and cached.

    Args:
        spec, warm: what determines the model.
        cache_dir: where trained base models are kept (None: neither read nor written).
        on_step: called with the step after every warm-start step (progress bars); not called when loading.
        shipped: load the package's base model of this recipe when it has one (:func:`shipped_path`).
        task_name: the task (``tasks.TASKS``) whose warm-start data make the base model.

    Returns:
        ``(model, origin)``, origin a short note of where the weights came from (for the run's log).
    """
    model = build_model(spec, warm.seed, task_name)
    if shipped and shipped_path(spec, warm, task_name).exists():
        path = shipped_path(spec, warm, task_name)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval(), f"shipped with the package ({path.name})"
    key = cache_key(spec, warm, task_name)
    path = None if cache_dir is None else Path(cache_dir) / f"{key}.pt"
    if path is not None and path.exists():
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval(), f"cached {path}"
    generator = torch.Generator().manual_seed(warm.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=warm.lr, weight_decay=0.0)
    warmup = max(1, warm.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (warm.steps - s) / max(1, warm.steps - warmup)))
    )
    model.train()
    for step in range(warm.steps):
        batch = _sft_batch(warm, generator, task_name)
        loss = -log_likelihood(model, batch) / batch.response_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if on_step is not None:
            on_step(step + 1)
    model.eval()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)  # atomic: concurrent runs never read a half-written file
        return model, f"trained ({warm.steps} steps), cached at {path}"
    return model, f"trained ({warm.steps} steps), not cached"
