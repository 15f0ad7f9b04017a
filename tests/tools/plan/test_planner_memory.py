"""The memory model against figures computed by hand for tiny models, and the shipped architecture facts against
the published parameter counts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from respo_verl.layout.models import QWEN3_1P7B, QWEN3_30B_A3B, ModelConfigError, ModelShape, shape_from_hf_config
from respo_verl.layout.parallel import Layout
from respo_verl.tools.plan.memory import (
    GIB,
    RUNTIME_RESERVE_GIB,
    VLLM_OVERHEAD_GIB,
    estimate_memory,
    memory_violations,
)

# L = 2, h = 64, 4 heads / 2 KV heads of 16, vocab 50, dense FFN 128, untied.
TINY = ModelShape("tiny", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=50, tie_word_embeddings=False, ffn_hidden_size=128)  # fmt: skip
# By hand: attention q 64*64 + k,v 2*64*32 + o 64*64 + q/k norms 2*16 + layer norms 2*64 = 12448;
# MLP 3*64*128 = 24576; embedding 50*64 = 3200; output 3200 + final norm 64 = 3264.
TINY_LAYER = 12448 + 24576
TINY_TOTAL = 2 * TINY_LAYER + 3200 + 3264  # 80512
# On one of 2 TP ranks: megatron splits the projections, MLP, embedding and output layer, and keeps the norms whole
# (q/k norms 2*16 and layer norms 2*64 per layer, the final norm 64): 384 replicated, (80512 - 384) / 2 + 384.
TINY_REPLICATED = 2 * (2 * 16 + 2 * 64) + 64
TINY_TP2 = (TINY_TOTAL - TINY_REPLICATED) / 2 + TINY_REPLICATED  # 40448


def _megatron(**kw) -> Layout:
    base = dict(backend="megatron", nnodes=1, gpus_per_node=4, tp=2, etp=2, sequence_parallel=True,
                ppo_max_token_len_per_gpu=1000, log_prob_max_token_len_per_gpu=1000, rollout_tp=2,
                rollout_memory_fraction=0.5, train_batch_size=4, ppo_mini_batch_size=4)  # fmt: skip
    base.update(kw)
    return Layout(**base)


def test_tiny_parameter_count():
    assert TINY.total_params == TINY_TOTAL == 80512


def test_megatron_static_memory_by_hand():
    mem = estimate_memory(TINY, _megatron(), gpu_gib=80.0)
    # TP 2, PP 1: every parameter but the norms is split in two; DP = 4 / 2 = 2 shards the optimizer.
    per_gpu = TINY_TP2  # 40448
    assert mem.params_per_gpu == int(per_gpu)
    assert mem.weights_gib * GIB == pytest.approx(2 * per_gpu)
    assert mem.grads_gib * GIB == pytest.approx(4 * per_gpu)
    assert mem.optimizer_gib * GIB == pytest.approx(12 * per_gpu / 2)


def test_megatron_activations_and_logits_by_hand():
    mem = estimate_memory(TINY, _megatron(), gpu_gib=80.0)
    # per token and layer, TP 2 with sequence parallelism (elements):
    #   attention 2*64/2 + (4 + 2*2)*16/2 + 4*16/2 = 64 + 64 + 32 = 160
    #   MLP       2*64/2 + 3*128/2               = 64 + 192      = 256
    per_layer_bytes = 2 * 1000 * (160 + 256)  # bf16, 1000 tokens: 832000
    assert mem.activations_gib * GIB == pytest.approx(2 * per_layer_bytes)  # no recompute, 2 layers
    assert mem.logits_gib * GIB == pytest.approx(1000 * 50 / 2 * 10)  # V/TP, 10 B per element
    full = estimate_memory(TINY, _megatron(recompute_granularity="full", recompute_method="uniform",
                                           recompute_num_layers=1), gpu_gib=80.0)  # fmt: skip
    # full recompute: two checkpointed inputs (64/2 elements per token) + one recomputed layer
    assert full.activations_gib * GIB == pytest.approx(2 * (2 * 1000 * 32) + per_layer_bytes)
    pp2 = estimate_memory(TINY, _megatron(pp=2, gpus_per_node=4, tp=1, etp=1, sequence_parallel=False), gpu_gib=80.0)
    # PP 2: one layer per stage, two micro-batches in flight on the first stage; TP 1 -> no sharding
    per_layer_tp1 = 2 * 1000 * ((2 * 64 + 8 * 16 + 4 * 16) + (2 * 64 + 3 * 128))
    assert pp2.activations_gib * GIB == pytest.approx(2 * per_layer_tp1)
    # the worst stage carries one layer plus the larger end (the output layer, 3264 > 3200)
    assert pp2.params_per_gpu == TINY_LAYER + 3264


def test_totals_add_up_and_rollout_by_hand():
    mem = estimate_memory(TINY, _megatron(), gpu_gib=10.0)
    parts = mem.weights_gib + mem.grads_gib + mem.optimizer_gib + mem.activations_gib + mem.logits_gib
    assert mem.train_gib == pytest.approx(parts + RUNTIME_RESERVE_GIB)
    # vLLM TP 2: weights 2 B * 80538 / 2; KV per token 2 (K, V) * 2 layers * 1 KV head per rank * 16 * 2 B = 128 B
    vllm_weights = 2 * TINY_TOTAL / 2
    assert mem.rollout_weights_gib * GIB == pytest.approx(vllm_weights)
    kv = 0.5 * 10 * GIB - vllm_weights - VLLM_OVERHEAD_GIB * GIB
    assert mem.rollout_kv_tokens == int(kv // 128)
    resident = mem.weights_gib + mem.grads_gib + mem.optimizer_gib  # nothing offloaded
    assert mem.rollout_gib == pytest.approx(0.5 * 10 + resident + RUNTIME_RESERVE_GIB)
    offloaded = estimate_memory(TINY, _megatron(param_offload=True, optimizer_offload=True), gpu_gib=10.0)
    assert offloaded.rollout_resident_gib == 0
    assert offloaded.train_gib == pytest.approx(mem.train_gib)  # verl reloads everything for the update


def test_fsdp_by_hand():
    lay = Layout(backend="fsdp", nnodes=1, gpus_per_node=4, ulysses_sp=2, ppo_max_token_len_per_gpu=1000,
                 log_prob_max_token_len_per_gpu=1000, rollout_tp=2)  # fmt: skip
    mem = estimate_memory(TINY, lay, gpu_gib=80.0)
    shard = TINY_TOTAL / 4
    gathered = 2 * (2 * TINY_LAYER + 3200)  # two bf16 layers + the embedding
    assert mem.weights_gib * GIB == pytest.approx(4 * shard + gathered)
    assert mem.grads_gib * GIB == pytest.approx(4 * shard)
    assert mem.optimizer_gib * GIB == pytest.approx(8 * shard)
    per_layer = 2 * 1000 * ((2 * 64 + 8 * 16 + 4 * 16) + (2 * 64 + 3 * 128))
    assert mem.activations_gib * GIB == pytest.approx(2 * 2 * 1000 * 64 + per_layer)  # checkpointing
    assert mem.logits_gib * GIB == pytest.approx(1000 * 50 * 10)


def test_moe_expert_sharding_and_replay_payload_by_hand():
    moe = ModelShape("tiny-moe", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                     vocab_size=50, tie_word_embeddings=True, num_experts=4, moe_topk=2, moe_ffn_hidden_size=32,
                     num_moe_layers=2)  # fmt: skip
    lay = _megatron(tp=1, etp=1, ep=4, sequence_parallel=False, train_batch_size=2, rollout_n=3,
                    max_prompt_length=10, max_response_length=20)  # fmt: skip
    mem = estimate_memory(moe, lay, gpu_gib=80.0)
    expert = 3 * 64 * 32
    dense = 2 * (12448 + 64 * 4) + 3200 + 64  # attention + routers, embedding, final norm (tied: no output layer)
    assert mem.params_per_gpu == int(dense + 2 * 4 * expert / 4)
    # optimizer: dense over DP = 4 / 1, experts over expert-DP = 4 / 4 = 1
    assert mem.optimizer_gib * GIB == pytest.approx(12 * (dense / 4 + 2 * expert))
    # replay: batch 2 * n 3 * 30 tokens * 2 layers * top-2, one byte per id (R3's uint8, 4 experts)
    assert mem.replay_step_gib * GIB == pytest.approx(2 * 3 * 30 * 2 * 2 * 1)
    assert mem.replay_sample_mib * 2**20 == 30 * 2 * 2 and mem.replay_index_bytes == 1
    # int16 for R2 (verl's trainer records them) and above 256 experts
    r2 = estimate_memory(moe, dataclasses.replace(lay, replay="r2"), gpu_gib=80.0)
    wide = estimate_memory(dataclasses.replace(moe, num_experts=257), lay, gpu_gib=80.0)
    assert r2.replay_step_gib == wide.replay_step_gib == 2 * mem.replay_step_gib
    assert estimate_memory(dataclasses.replace(moe, num_experts=256), lay, gpu_gib=80.0).replay_index_bytes == 1


def test_r3_routes_of_a_step_are_held_against_the_taskrunner_node_s_object_store():
    lay = dataclasses.replace(_megatron(), train_batch_size=1024, rollout_n=8, max_prompt_length=1024,
                              max_response_length=8192, replay="r3")  # fmt: skip
    # 1024 * 8 samples * 9216 tokens * 48 layers * top-8, uint8: 27 GiB
    step = estimate_memory(QWEN3_30B_A3B, lay, gpu_gib=80.0, host_gib=2e12 / GIB)
    assert step.replay_step_gib == pytest.approx(27.0) and step.object_store_gib == pytest.approx(200e9 / GIB)
    assert not [v for v in memory_violations(lay, step) if v.rule == "routing-replay-host"]
    small = estimate_memory(QWEN3_30B_A3B, lay, gpu_gib=80.0, host_gib=64.0)  # 30 % of 64 GiB < 27 GiB
    assert small.object_store_gib == pytest.approx(0.3 * 64)
    (refused,) = [v for v in memory_violations(lay, small) if v.rule == "routing-replay-host"]
    assert "27.0 GiB" in refused.message and "data.train_batch_size" in refused.message
    off = dataclasses.replace(lay, replay="off")  # nothing travels: shown, not held
    assert not [v for v in memory_violations(off, small) if v.rule == "routing-replay-host"]


def test_shipped_models_match_published_sizes():
    assert QWEN3_30B_A3B.total_params / 1e9 == pytest.approx(30.5, abs=0.1)  # "30.5B total"
    assert QWEN3_30B_A3B.active_params / 1e9 == pytest.approx(3.3, abs=0.1)  # "3.3B activated"
    assert QWEN3_1P7B.total_params / 1e9 == pytest.approx(1.7, abs=0.05)
    non_embedding = QWEN3_1P7B.total_params - QWEN3_1P7B.embedding_params
    assert non_embedding / 1e9 == pytest.approx(1.4, abs=0.05)  # "1.4B non-embedding"


def test_hf_config_round_trip(tmp_path):
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 48, "hidden_size": 2048,
           "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
           "tie_word_embeddings": False, "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8,
           "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = shape_from_hf_config(tmp_path)
    assert shape.total_params == QWEN3_30B_A3B.total_params
    assert shape.num_moe_layers == 48


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "not found"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"hidden_size": 8}', "lacks num_hidden_layers"),
        (
            '{"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10, "num_experts": 4}',
            "no num_experts_per_tok",
        ),
    ],
)
def test_bad_model_configs_fail_clearly(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ModelConfigError, match=message):
        shape_from_hf_config(path)


@pytest.mark.parametrize("precision_aware", [False, True])
def test_megatron_cpu_optimizer_terms_by_hand(precision_aware):
    # Megatron's HybridDeviceOptimizer keeps an fp32 parameter copy, an fp32 gradient copy and both Adam moments on
    # the host: 16 B per parameter of the optimizer shard. Without the precision-aware optimizer the
    # DistributedOptimizer's fp32 main parameters (4 B) also stay on the GPU.
    lay = _megatron(optimizer_cpu_offload=True, optimizer_cpu_offload_fraction=1.0,
                    precision_aware_optimizer=precision_aware)  # fmt: skip
    mem = estimate_memory(TINY, lay, gpu_gib=80.0)
    shard = TINY_TP2 / 2  # TP 2, then DP 2 for the distributed optimizer
    assert mem.cpu_optimizer_gib * GIB == pytest.approx(16 * shard)
    assert mem.optimizer_gib * GIB == pytest.approx(0 if precision_aware else 4 * shard)
    assert mem.host_offload_gib_per_node * GIB == pytest.approx(4 * 16 * shard)  # 4 GPUs on the node
    half = estimate_memory(TINY, dataclasses.replace(lay, optimizer_cpu_offload_fraction=0.5), gpu_gib=80.0)
    gpu_part = 12 * shard / 2 + (0 if precision_aware else 4 * shard / 2)
    assert half.optimizer_gib * GIB == pytest.approx(gpu_part)
    assert half.cpu_optimizer_gib * GIB == pytest.approx(16 * shard / 2)


def test_param_offload_copies_weights_and_frees_gradients():
    # verl's offload_megatron_model_to_cpu copies the bf16 param buffer to pinned host memory and resizes the fp32
    # grad buffer to 0 without a copy: the host holds 2 B per parameter, not 6.
    mem = estimate_memory(TINY, _megatron(param_offload=True), gpu_gib=80.0)
    assert mem.host_offload_gib_per_node * GIB == pytest.approx(4 * 2 * TINY_TP2)
    both = estimate_memory(TINY, _megatron(param_offload=True, optimizer_offload=True), gpu_gib=80.0)
    assert both.host_offload_gib_per_node * GIB == pytest.approx(4 * (2 * TINY_TP2 + 12 * TINY_TP2 / 2))


def test_vllm_startup_sees_the_trainer_before_its_first_step():
    # verl builds the trainer before vLLM: bf16 weights, the fp32 grad buffer and the fp32 main parameters are on
    # the GPU, Adam's moments are not yet; vLLM needs fraction x total free.
    mem = estimate_memory(TINY, _megatron(), gpu_gib=10.0)
    resident = 2 * TINY_TP2 + 4 * TINY_TP2 + 4 * TINY_TP2 / 2
    assert mem.rollout_startup_resident_gib * GIB == pytest.approx(resident)
    assert mem.rollout_startup_free_gib * GIB == pytest.approx(10 * GIB - resident - RUNTIME_RESERVE_GIB * GIB)
    assert mem.rollout_startup_needed_gib == pytest.approx(0.5 * 10)
    offloaded = estimate_memory(TINY, _megatron(param_offload=True, optimizer_offload=True), gpu_gib=10.0)
    assert offloaded.rollout_startup_resident_gib == 0


def test_fsdp_follows_model_dtype():
    lay = Layout(backend="fsdp", nnodes=1, gpus_per_node=4, ulysses_sp=2, ppo_max_token_len_per_gpu=1000,
                 log_prob_max_token_len_per_gpu=1000, rollout_tp=2, model_dtype="bf16")  # fmt: skip
    mem = estimate_memory(TINY, lay, gpu_gib=80.0)
    shard = TINY_TOTAL / 4
    gathered = 2 * (2 * TINY_LAYER + 3200)
    # bf16 parameters; torch AdamW keeps its moments (and the gradients are) in the parameter's dtype
    assert mem.weights_gib * GIB == pytest.approx(2 * shard + gathered)
    assert mem.grads_gib * GIB == pytest.approx(2 * shard)
    assert mem.optimizer_gib * GIB == pytest.approx(4 * shard)
