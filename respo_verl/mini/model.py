"""The tiny policy (a ``transformers`` Qwen3 or Qwen3-MoE built from a config) and its cached warm start.

The "base model" of the experiment is the tiny model after a brief supervised warm start on a mixture of premature
answers (``? <eos>``: no work) and correct worked answers (``task.py``). It is deterministic for a given
specification, seed and machine. The package ships the base models of the default recipe (:data:`SHIPPED_DIR`, both
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

from respo_verl.mini import task
from respo_verl.mini.rollout import Rollout, response_log_prob

DEFAULT_CACHE_DIR = Path(os.path.expanduser("~/.cache/respo_verl/mini"))
# The base models of the default recipe (warm seeds 0 and 1), trained by `warm_start` on the project's machine and
# shipped with the package, so that every machine starts RL from the same weights and no run pays for a warm start
# (docs/mini.md, "Base models"). `respo-verl mini --train-base` trains them afresh instead.
SHIPPED_DIR = Path(__file__).parent / "base_models"
# Bumped whenever the task or the warm-start recipe changes, so that stale cached base models are not reused.
WARM_START_VERSION = 7


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

    Attributes:
        steps: optimizer steps; enough that the base model has learnt both answer formats and that its arithmetic is
            near-certain when sampled at temperature 1 (docs/mini.md).
        batch_size: examples per step.
        lr: peak AdamW learning rate (linear warm-up over the first 5 % of the steps, then linear decay to 0: a
            constant rate of this size lets the tiny model diverge late in the warm start).
        direct_share: share of premature answers ``? <eos>`` in the data; the rest is worked to the end (or, with
            an abort hazard, guessed after some steps), which aims the base model's success at 20–40 % once its
            arithmetic is near-certain (docs/mini.md).
        abort_hazard: chance that a worked answer stops after each of its first K − 1 steps and guesses (0 by
            default: RL that suppresses such a guess after a running sum also suppresses the final ``#`` after the
            last one, and the positives then starve through that one token; docs/mini.md).
        arith_weight: weight in the loss of the arithmetic tokens of the data (digit copies, running sums, the final
            answer of a worked answer); every other token weighs 1. The fillers' loss is irreducible (about 1.88
            nats a token) and they are nine tenths of a worked answer; weighting the arithmetic lets it become
            near-certain when sampled at temperature 1, not only right under teacher forcing, and gives it the
            margin to stay so under the RL updates.
        seed: initialisation and data seed (the experiment's warm-start seed).
    """

    steps: int = 2500
    batch_size: int = 64
    lr: float = 3e-3
    direct_share: float = 0.65
    abort_hazard: float = 0.0
    arith_weight: float = 16.0
    seed: int = 0


def build_model(spec: ModelSpec, seed: int) -> torch.nn.Module:
    """A freshly initialised tiny causal LM in fp32 on CPU."""
    common = dict(
        vocab_size=task.VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=task.PROMPT_LEN + task.MAX_RESPONSE_LEN,
        tie_word_embeddings=True,
        pad_token_id=task.PAD,
        bos_token_id=task.BOS,
        eos_token_id=task.EOS,
    )
    torch.manual_seed(seed)
    if spec.moe:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            **common,
            intermediate_size=spec.intermediate_size,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_token,
            moe_intermediate_size=spec.moe_intermediate_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=spec.intermediate_size))
    return model.float().eval()


def recipe_key(spec: ModelSpec, warm: WarmStart) -> str:
    """Hash of the recipe of the base model: the model, the warm start and the task (not the machine)."""
    payload = json.dumps(
        {
            "spec": asdict(spec),
            "warm": asdict(warm),
            "version": WARM_START_VERSION,
            "vocab": task.VOCAB_SIZE,
            "task": [
                task.N_DIGITS,
                task.MAX_DIGIT,
                task.FILLERS_PER_STEP,
                task.N_FILLERS,
                task.FREE_FILLER_SHARE,
                task.FILLER_SUCCESSORS,
            ],
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cache_key(spec: ModelSpec, warm: WarmStart) -> str:
    """Hash of everything that determines a base model trained here: the recipe and the torch version."""
    payload = json.dumps({"recipe": recipe_key(spec, warm), "torch": torch.__version__.split("+")[0]})
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def shipped_path(spec: ModelSpec, warm: WarmStart) -> Path:
    """Where the package keeps the base model of this recipe, when it ships one (:data:`SHIPPED_DIR`)."""
    return SHIPPED_DIR / f"{recipe_key(spec, warm)}.pt"


def _sft_batch(warm: WarmStart, generator: torch.Generator) -> tuple[Rollout, torch.Tensor]:
    """A batch of warm-start data and the loss weight of every response token (``warm.arith_weight`` on the
    arithmetic tokens, 1 elsewhere)."""
    prompts = task.sample_prompts(warm.batch_size, generator)
    direct = torch.rand(warm.batch_size, generator=generator) < warm.direct_share  # (N,)
    # Steps before the answer: the first step m ≥ 1 after which the worked answer aborts, K when it never does.
    aborts = torch.rand(warm.batch_size, task.N_DIGITS - 1, generator=generator) < warm.abort_hazard  # (N, K − 1)
    aborts = torch.cat([aborts, torch.ones(warm.batch_size, 1, dtype=torch.bool)], dim=1)  # (N, K)
    n_steps = torch.where(direct, 0, aborts.int().argmax(dim=1) + 1)  # (N,)
    response = torch.full((warm.batch_size, task.MAX_RESPONSE_LEN), task.PAD, dtype=torch.long)
    weight = torch.ones(warm.batch_size, task.MAX_RESPONSE_LEN)
    for i in range(warm.batch_size):
        digits, m = prompts.digits[i].tolist(), int(n_steps[i])
        if bool(direct[i]):
            row = task.give_up_answer()
        elif m == task.N_DIGITS:
            row = task.worked_answer(digits, generator)
            weight[i, len(row) - 2] = warm.arith_weight  # the final answer copies the last running sum
        else:
            row = task.premature_answer(digits, m, generator)
        response[i, : len(row)] = torch.tensor(row)
        for step in range(m):
            digit_pos = 1 + step * task.STEP_LEN + task.FILLERS_PER_STEP
            weight[i, digit_pos : digit_pos + 2] = warm.arith_weight  # the digit copy and the running sum
    mask = torch.arange(task.MAX_RESPONSE_LEN).unsqueeze(0) < task.response_lengths(response).unsqueeze(1)
    return Rollout(prompts, response, mask), weight


def _weighted_log_prob(model: torch.nn.Module, batch: Rollout, weight: torch.Tensor) -> torch.Tensor:
    """Σ weight · log π over the response tokens of ``batch``, one forward per response length.

    The rows of a warm-start batch have a few lengths (``? <eos>`` and worked answers): each group is cut to its
    own length, so the premature answers, two tokens and most of the rows, do not pay for a worked answer's
    length. With causal attention and right padding, the tokens after a response never reach it, so this is the
    loss of the whole padded batch (docs/mini.md, "Base models").
    """
    lengths = batch.response_mask.sum(dim=1)  # (N,)
    total = torch.zeros(())
    for n in lengths.unique().tolist():
        rows = torch.nonzero(lengths == n).flatten()
        group = batch.rows(rows)
        group = Rollout(group.prompts, group.response[:, :n], group.response_mask[:, :n])
        total = total + (response_log_prob(model, group) * weight[rows, :n]).sum()
    return total


def warm_start(
    spec: ModelSpec,
    warm: WarmStart,
    cache_dir: Path | None = DEFAULT_CACHE_DIR,
    on_step: Callable[[int], None] | None = None,
    shipped: bool = True,
) -> tuple[torch.nn.Module, str]:
    """The base model: the package's copy of it, or the cached one, or trained (minutes) and cached.

    Args:
        spec, warm: what determines the model.
        cache_dir: where trained base models are kept (None: neither read nor written).
        on_step: called with the step after every warm-start step (progress bars); not called when loading.
        shipped: load the package's base model of this recipe when it has one (:func:`shipped_path`).

    Returns:
        ``(model, origin)``, origin a short note of where the weights came from (for the run's log).
    """
    model = build_model(spec, warm.seed)
    if shipped and shipped_path(spec, warm).exists():
        path = shipped_path(spec, warm)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval(), f"shipped with the package ({path.name})"
    key = cache_key(spec, warm)
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
        batch, weight = _sft_batch(warm, generator)
        loss = -_weighted_log_prob(model, batch, weight) / batch.response_mask.sum()
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
