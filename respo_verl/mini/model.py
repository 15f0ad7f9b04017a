"""The tiny policy (a ``transformers`` Qwen3 or Qwen3-MoE built from a config) and its cached warm start.

The "base model" of the experiment is the tiny model after a brief supervised warm start on a mixture of guessed
direct answers and correct thinking-aloud answers (``task.py``). It is deterministic for a given specification and
seed, and cached under ``~/.cache/respo_verl/mini/<key>.pt`` (key = hash of everything that determines it).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from respo_verl.mini import task
from respo_verl.mini.rollout import Rollout, response_log_prob

DEFAULT_CACHE_DIR = Path(os.path.expanduser("~/.cache/respo_verl/mini"))
# Bumped whenever the task or the warm-start recipe changes, so that stale cached base models are not reused.
WARM_START_VERSION = 1


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
        steps: optimizer steps; few enough that the running sums are still unreliable (the base model must succeed
            rarely), enough that it has learnt both answer formats.
        batch_size: examples per step.
        lr: AdamW learning rate.
        think_share: share of thinking-aloud answers in the data (the rest are guessed direct answers).
        seed: initialisation and data seed.
    """

    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-3
    think_share: float = 0.3
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


def cache_key(spec: ModelSpec, warm: WarmStart) -> str:
    """Hash of everything that determines the base model."""
    payload = json.dumps(
        {
            "spec": asdict(spec),
            "warm": asdict(warm),
            "version": WARM_START_VERSION,
            "vocab": task.VOCAB_SIZE,
            "k": [task.K_MIN, task.K_MAX],
            "torch": torch.__version__.split("+")[0],
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _sft_batch(warm: WarmStart, generator: torch.Generator) -> Rollout:
    prompts = task.sample_prompts(warm.batch_size, generator)
    think = torch.rand(warm.batch_size, generator=generator) < warm.think_share  # (N,)
    response = torch.full((warm.batch_size, task.MAX_RESPONSE_LEN), task.PAD, dtype=torch.long)
    for i in range(warm.batch_size):
        if think[i]:
            k = int((prompts.digits[i] >= 0).sum())
            row = task.thinking_answer([int(d) for d in prompts.digits[i, :k]], generator)
        else:
            row = task.direct_guess(generator)
        response[i, : len(row)] = torch.tensor(row)
    mask = torch.arange(task.MAX_RESPONSE_LEN).unsqueeze(0) < task.response_lengths(response).unsqueeze(1)
    return Rollout(prompts, response, mask)


def warm_start(
    spec: ModelSpec, warm: WarmStart, cache_dir: Path | None = DEFAULT_CACHE_DIR
) -> tuple[torch.nn.Module, str]:
    """The base model: loaded from the cache, or trained (seconds) and cached.

    Returns:
        ``(model, origin)``, origin a short note of where the weights came from (for the run's log).
    """
    model = build_model(spec, warm.seed)
    key = cache_key(spec, warm)
    path = None if cache_dir is None else Path(cache_dir) / f"{key}.pt"
    if path is not None and path.exists():
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval(), f"cached {path}"
    generator = torch.Generator().manual_seed(warm.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=warm.lr, weight_decay=0.0)
    model.train()
    for _ in range(warm.steps):
        batch = _sft_batch(warm, generator)
        log_prob = response_log_prob(model, batch)  # (N, T)
        loss = -(log_prob * batch.response_mask).sum() / batch.response_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)  # atomic: concurrent runs never read a half-written file
        return model, f"trained ({warm.steps} steps), cached at {path}"
    return model, f"trained ({warm.steps} steps), not cached"
