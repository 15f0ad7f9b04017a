"""The tiny Qwen3 / Qwen3-MoE that runs on a CPU: one factory for the CPU kit and for the research code.

``shape`` is any object with the Qwen3 shape's fields (``hidden_size``, ``intermediate_size``, ``num_layers``,
``num_heads``, ``num_kv_heads``, ``head_dim``, ``moe``, and for ``moe`` also ``num_experts``, ``experts_per_token``,
``moe_intermediate_size``), such as :class:`respo_verl.cpu.kit.build.KitSpec`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Where everything this package builds on a CPU machine is cached (the kit, the research code's base models).
CACHE_ROOT = Path("~/.cache/respo_verl")


def build_tiny_qwen3(shape: Any, *, vocab_size: int, seed: int, moe_config: dict | None = None, **config: Any):
    """A freshly initialised ``Qwen3ForCausalLM`` (or, with ``shape.moe``, ``Qwen3MoeForCausalLM``, every layer
    sparse, top-k routing with normalised top-k probabilities, as Qwen3-30B-A3B) in fp32 on the CPU.

    Args:
        shape: the model's shape (see the module docstring).
        vocab_size: the tokenizer's size.
        seed: ``torch.manual_seed`` right before the weights are initialised.
        moe_config: further ``Qwen3MoeConfig`` keys for the MoE model.
        config: further config keys for both (special token ids, positions, tied embeddings, attention).
    """
    import torch

    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        **config,
    )
    torch.manual_seed(seed)
    if shape.moe:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        moe = Qwen3MoeConfig(
            **common,
            intermediate_size=shape.intermediate_size,
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.experts_per_token,
            moe_intermediate_size=shape.moe_intermediate_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            **(moe_config or {}),
        )
        return Qwen3MoeForCausalLM(moe).float()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=shape.intermediate_size)).float()
