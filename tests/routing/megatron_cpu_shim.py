"""TEST-ONLY: run a tiny megatron-core 0.16.1 GPTModel with MoE on CPU (gloo world of size 1).

megatron-core hard-codes CUDA in a few places that a CPU forward/backward reaches. This shim neutralises exactly
those, for the duration of a ``with megatron_cpu():`` block, and restores everything afterwards:

- ``torch.cuda.current_device`` → ``"cpu"`` (buffers, the router's weight move in ``gating()``);
- CUDA streams / events → objects whose methods do nothing (the token dispatchers record and wait on them);
- the model-parallel CUDA RNG tracker's ``fork`` → a null context; CUDA RNG state get/set (activation recompute) →
  the CPU generator's state, so a recompute replays the same random stream;
- ``moe_utils.te_general_gemm`` → ``None`` when Transformer Engine is absent (0.16.1 reads the name unguarded).

It is a mock of the device, not of megatron: every megatron code path above runs as written. Never import it
outside tests.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist

SEQ, BATCH = 6, 2
VOCAB = 64
NUM_LAYERS, NUM_EXPERTS, TOP_K = 3, 8, 2


class _NoOpEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _NoOpStream(_NoOpEvent):
    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpEvent()


@contextlib.contextmanager
def megatron_cpu(pipeline_model_parallel_size: int = 1) -> Iterator[None]:
    """Patch CUDA-only calls and start megatron's model parallel state (TP = 1, PP as given) on a gloo world: the
    caller's process group if one is initialised (e.g. two ranks for PP = 2), else a world of size 1."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils

    tracker = megatron_random.get_cuda_rng_tracker()
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context
        patch(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        patch(mock.patch.object(torch.cuda, "Stream", _NoOpStream))
        patch(mock.patch.object(torch.cuda, "Event", _NoOpEvent))
        patch(mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: _NoOpStream()))
        patch(mock.patch.object(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()))
        patch(mock.patch.object(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()))
        patch(mock.patch.object(megatron_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()))
        patch(
            mock.patch.object(megatron_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
        )
        patch(mock.patch.object(tracker, "fork", lambda *a, **k: contextlib.nullcontext(), create=True))
        patch(mock.patch.object(tracker, "get_states", lambda: {}, create=True))
        patch(mock.patch.object(tracker, "set_states", lambda states: None, create=True))
        if not hasattr(moe_utils, "te_general_gemm"):
            patch(mock.patch.object(moe_utils, "te_general_gemm", None, create=True))
        store_dir = patch(tempfile.TemporaryDirectory())
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=f"file://{os.path.join(store_dir, 'store')}", rank=0, world_size=1
            )
            stack.callback(dist.destroy_process_group)
        parallel_state.initialize_model_parallel(1, pipeline_model_parallel_size)
        stack.callback(parallel_state.destroy_model_parallel)
        yield


def tiny_config(**overrides):
    """Qwen3-30B-A3B's MoE routing scaled down: every layer MoE, softmax router, top-k with normalised probs
    (top-k on logits then softmax over the k = softmax over all experts restricted to the top-k and renormalised),
    no aux loss, GQA, QK-norm, RMSNorm, SwiGLU, fp32, CPU initialisation."""
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
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, qk_layernorm=True, normalization="RMSNorm")
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
    position_ids = torch.arange(seq).expand(batch, seq)
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    return model(input_ids, position_ids, attention_mask=causal_mask)
