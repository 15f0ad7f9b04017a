"""megatron-core on CPU: a gloo world with megatron's model-parallel state, and a tiny GPTModel with MoE.

Used by the routing tests, ``scripts/bench/routing.py`` and ``scripts/gpu_check.sh`` (its CPU fallback). The device
stand-in itself is the version-keyed patch :data:`respo_verl.patches.megatron_core_0_16_1.CPU`; :func:`megatron_cpu`
applies it for the duration of a block together with the process group and megatron's parallel state, and undoes all
three afterwards.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist

from respo_verl.patches.megatron_core_0_16_1 import CPU as cpu_patch

# The tiny model's sizes (tests build inputs of these shapes).
SEQ, BATCH = 6, 2
VOCAB = 64
NUM_LAYERS, NUM_EXPERTS, TOP_K = 3, 8, 2


@contextlib.contextmanager
def megatron_cpu(
    pipeline_model_parallel_size: int = 1, virtual_pipeline_model_parallel_size: int | None = None
) -> Iterator[None]:
    """Apply the CPU patch and start megatron's model-parallel state (TP = 1, PP and VPP as given) on a gloo world:
    the caller's process group if one is initialised (e.g. two ranks for PP = 2), else a world of size 1."""
    from megatron.core import parallel_state

    with contextlib.ExitStack() as stack:
        if cpu_patch.apply():
            stack.callback(cpu_patch.remove)
        store_dir = stack.enter_context(tempfile.TemporaryDirectory())
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=f"file://{os.path.join(store_dir, 'store')}", rank=0, world_size=1
            )
            stack.callback(dist.destroy_process_group)
        parallel_state.initialize_model_parallel(
            1,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        )
        stack.callback(parallel_state.destroy_model_parallel)
        yield


def tiny_config(**overrides):
    """Qwen3-30B-A3B's MoE routing scaled down: every layer MoE, softmax router, top-k with normalised probs
    (top-k on logits then softmax over the k = softmax over all experts restricted to the top-k and renormalised),
    no aux loss, GQA, QK-norm, RMSNorm, SwiGLU, fp32, CPU initialisation; ``overrides`` replace any field."""
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=NUM_LAYERS, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
        kv_channels=8, num_moe_experts=NUM_EXPERTS, moe_router_topk=TOP_K, moe_ffn_hidden_size=16,
        moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        use_cpu_initialization=True, params_dtype=torch.float32, bf16=False, fp16=False, gated_linear_unit=True,
        normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.5, moe_enable_routing_replay=True,
    )  # fmt: skip
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def tiny_gpt_moe(seed: int = 0, gpt_kwargs: dict | None = None, **overrides):
    """A tiny GPTModel on the local (non-TE) layer spec; ``gpt_kwargs`` go to ``GPTModel`` (e.g. ``pre_process``,
    ``post_process`` of a pipeline stage), ``overrides`` to :func:`tiny_config`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = tiny_config(**overrides)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=True, normalization="RMSNorm")
    torch.manual_seed(seed)
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=16,
        position_embedding_type="rope",
        **(gpt_kwargs or {}),
    )


def forward(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits (batch, seq, vocab) with an explicit causal mask (megatron builds its default one on CUDA)."""
    batch, seq = input_ids.shape
    position_ids = torch.arange(seq).expand(batch, seq)  # (B, T)
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    return model(input_ids, position_ids, attention_mask=causal_mask)
