"""Per-GPU memory estimate of a verl job: training step, old-log-prob forward, and vLLM rollout.

How the estimate is made (bytes; every figure is per GPU, for the most loaded pipeline stage):

Megatron (``model_engine=megatron``)
    Parameters held by a GPU: the non-expert part of its ``L/PP`` layers divided by TP, its experts divided by
    EP·ETP, plus the embedding (first stage) or output layer (last stage) divided by TP; with PP = 1 both.
    weights    = 2 B/param (bf16 model parameters).
    gradients  = 4 B/param: the fp32 main-grad buffer of megatron's DDP (verl sets ``grad_reduce_in_fp32``).
    optimizer  = 12 B/param: fp32 main parameters (megatron ``DistributedOptimizer``,
                 ``shard_fp32_from_float16_groups``) + Adam ``exp_avg`` and ``exp_avg_sq`` in fp32, divided by the
                 data-parallel size of that parameter (dense: world/(TP·PP·CP); experts: world/(ETP·EP·PP)) with
                 the distributed optimizer.
    CPU optimizer (``override_optimizer_config.optimizer_cpu_offload``, megatron ``HybridDeviceOptimizer``):
                 the fraction ``optimizer_offload_fraction`` of those shards is stepped on the host, which keeps
                 16 B/param there: an fp32 copy of the parameter, an fp32 copy of its gradient and both Adam
                 moments (``cpu_offloading/hybrid_optimizer.py``, ``_get_sub_optimizer_param_groups`` and
                 ``_set_sub_optimizer_grads``). The GPU keeps the fp32 main parameters of the offloaded part as
                 well (4 B/param) unless ``use_precision_aware_optimizer`` hands the bf16 shards to the optimizer
                 directly (``distrib_optimizer.py``: "main params are held by" the optimizer); megatron-LM's own
                 argument check requires the precision-aware optimizer with CPU offload (rule
                 ``optimizer-cpu-offload``).
    verl's own ``optimizer_offload`` only frees the states *between* updates: the train-mode context loads them
                 back for the whole update, so it lowers the rollout phase, not this one.
    activations per token and layer (bf16 elements): attention 2h/s + (n_q + 2·n_kv)·d/TP + n_q·d/TP;
                 MoE block 2h/s + 4E (fp32 router logits and probabilities) + k·(h + 3·f_e)/ETP;
                 dense MLP 2h/s + 3f/TP, where s = TP with sequence parallelism else 1 (flash attention keeps
                 no s×s scores). Full recompute keeps only each checkpoint's input (h/s per token) plus the
                 recomputed chunk; 'block' keeps n layers as inputs and the rest whole. One micro-batch holds
                 ``ppo_max_token_len_per_gpu`` tokens per GPU (verl packs budget × CP tokens and CP splits
                 them); with PP > 1 the first stage holds PP micro-batches in flight (1F1B).
    logits     = tokens × V/TP × 10 B (bf16 logits, their fp32 copy for log-softmax, and its fp32 gradient).

FSDP (``model_engine=dp``)
    verl keeps the sharded parameters in ``fsdp_config.model_dtype`` (fp32 by default, bf16 as the paper) and
    torch's AdamW creates its moments in the parameter's dtype, so parameters, gradients, m and v take
    4 × (2 or 4) B per parameter, divided by the FSDP group size; plus two gathered bf16 layers (the one computing
    and the one prefetched) and the gathered bf16 embedding. Activations as above with TP = 1; Ulysses SP keeps
    the per-GPU token count at the budget (the all-to-all moves heads, not tokens). Gradient checkpointing keeps
    each layer's input plus one layer.

Host memory (pinned, per node): the CPU optimizer's 16 B/param; with ``param_offload`` the bf16 weights (verl's
``offload_megatron_model_to_cpu`` copies ``param_data`` to a pinned buffer and *frees* ``grad_data`` without a
copy); with ``optimizer_offload`` whatever optimizer state the GPU held (``offload_megatron_optimizer``).

Routing replay (per step, not per GPU): layers × top-k expert ids per token, uint8 for R3 up to 256 experts (int16
above, and for R2), every sample at prompt_length + response_length: the most a step carries, since verl's
TransferQueue keeps each sample at its own length. They are held against Ray's default object store of the node
that gathers them, assumed to be the TaskRunner's: 30 % of its memory, at most 200 GB (verl's TransferQueue spreads
its storage units over the nodes, so this is the worst case of a one-node gather).

Old-log-prob forward: weights and gradient buffers stay allocated, no optimizer unless resident, one layer of
activations and fp32 logits (6 B per element) at ``log_prob_max_token_len_per_gpu``.

Rollout (vLLM, hybrid engine): vLLM takes ``gpu_memory_utilization`` × the GPU's *total* memory for its weights
(2 B/param divided by its TP·PP), its own activations and CUDA graphs (a fixed allowance) and the KV cache, which
gets the rest. Whatever the trainer leaves on the GPU meanwhile (weights and gradients unless ``param_offload``,
the optimizer unless ``optimizer_offload``) must fit next to it. vLLM also refuses to start when the free memory
at its start is below that fraction of the total (``vllm/v1/worker/gpu_worker.py``, ``Worker.init_device``; later
versions ``request_memory`` in ``vllm/v1/worker/utils.py``), and verl 0.9.1 starts its vLLM servers after the
trainer is built (``trainer/ppo/v1/trainer_base.py``: ``init_model`` of the actor, then
``LLMServerManager.create``), with the trainer's weights, gradient buffers and fp32 main parameters on the GPU
unless offloaded (``workers/engine/megatron/transformer_impl.py``, ``initialize``); Adam's moments do not exist
yet (created at the first step). ``rollout_startup_*`` model that check.

Every phase adds a fixed runtime reserve (CUDA context, NCCL communicators, MoE dispatcher buffers, allocator
fragmentation). Where it is rough: activation counts ignore kernel workspaces, fp32 norm upcasts inside HF
modules and uneven expert load (a hot expert can receive several times the mean token count); the pipeline
factor ignores VPP's extra in-flight chunks; the runtime reserve is a single constant. Treat a margin under
about 10 % as "measure before launching".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from respo_verl.layout.models import ModelShape
from respo_verl.layout.parallel import Layout
from respo_verl.layout.rules import Violation

GIB = 2**30
BF16_BYTES = 2
FP32_BYTES = 4
# megatron with bf16 params: fp32 main-grad buffer (verl sets grad_reduce_in_fp32 unless low-precision main grads).
MEGATRON_GRAD_BYTES = FP32_BYTES
# fp32 main parameters (DistributedOptimizer) and Adam exp_avg + exp_avg_sq (verl's default fp32 dtypes).
MEGATRON_MAIN_PARAM_BYTES = FP32_BYTES
MEGATRON_MOMENT_BYTES = 2 * FP32_BYTES
MEGATRON_OPTIMIZER_BYTES = MEGATRON_MAIN_PARAM_BYTES + MEGATRON_MOMENT_BYTES
# HybridDeviceOptimizer on the host: fp32 parameter copy, fp32 gradient copy, Adam exp_avg and exp_avg_sq.
MEGATRON_CPU_OPTIMIZER_HOST_BYTES = 4 * FP32_BYTES
# FSDP in verl: parameters in fsdp_config.model_dtype; gradients and torch AdamW's m and v follow that dtype.
FSDP_DTYPE_BYTES = {"fp32": FP32_BYTES, "float32": FP32_BYTES, "bf16": BF16_BYTES, "bfloat16": BF16_BYTES}
FSDP_PARAM_BYTES = FP32_BYTES  # verl's default model_dtype
FSDP_STATE_COPIES = 3  # gradient, exp_avg, exp_avg_sq
# FSDP gathers the layer being computed and prefetches the next one, in bf16.
FSDP_GATHERED_LAYERS = 2
# Training logits: bf16 logits, an fp32 copy for log-softmax, and the fp32 gradient of that copy.
LOGITS_TRAIN_BYTES = BF16_BYTES + FP32_BYTES + FP32_BYTES
# Forward-only logits: bf16 logits and the fp32 log-softmax.
LOGITS_FORWARD_BYTES = BF16_BYTES + FP32_BYTES
# CUDA context (~0.5-1 GiB), NCCL communicators, DeepEP/all-to-all buffers (1-3 GiB), allocator fragmentation.
RUNTIME_RESERVE_GIB = 5.0
# vLLM's own activations at max_num_batched_tokens plus captured CUDA graphs, inside its memory fraction.
VLLM_OVERHEAD_GIB = 2.0
# Expert ids per byte of R3's routes: vLLM's uint8 up to 256 experts, kept by respo-verl (verl_0_9_1_routes);
# verl's int16 above that, and for R2's routes, which verl's trainer records as int16.
UINT8_MAX_EXPERTS = 256
# Ray's default object store on a node: 30 % of its memory, at most 200 GB (ray_constants.py).
RAY_OBJECT_STORE_SHARE = 0.3
RAY_OBJECT_STORE_MAX_BYTES = 200e9


def route_index_bytes(num_experts: int, mode: str = "r3") -> int:
    """Bytes per expert id of the routes a step carries (see :data:`UINT8_MAX_EXPERTS`)."""
    return 1 if num_experts <= UINT8_MAX_EXPERTS and mode != "r2" else 2


def object_store_gib(host_gib: float) -> float:
    """Ray's default object store (GiB) on a node of ``host_gib`` GiB."""
    return min(RAY_OBJECT_STORE_SHARE * host_gib, RAY_OBJECT_STORE_MAX_BYTES / GIB)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU figures in GiB (``*_gib``) plus a few counts. See the module docstring for the model."""

    params_per_gpu: int
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    reserve_gib: float
    train_gib: float
    logprob_gib: float
    rollout_weights_gib: float
    rollout_kv_gib: float
    rollout_kv_tokens: int
    rollout_resident_gib: float
    rollout_gib: float
    cpu_optimizer_gib: float
    replay_step_gib: float
    replay_microbatch_mib: float
    host_offload_gib_per_node: float
    gpu_gib: float
    rollout_startup_resident_gib: float = 0.0  # trainer state on the GPU when vLLM starts
    rollout_startup_free_gib: float = 0.0  # free memory vLLM sees at its start (capacity - resident - reserve)
    rollout_startup_needed_gib: float = 0.0  # gpu_memory_utilization x capacity (vLLM's start-up check)
    replay_index_bytes: int = 0  # bytes per expert id of the step's routes
    replay_sample_mib: float = 0.0  # one sample's routes at prompt_length + response_length
    object_store_gib: float = 0.0  # Ray's default object store of the TaskRunner's node (0: host memory unknown)

    @property
    def static_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib

    @property
    def peak_gib(self) -> float:
        return max(self.train_gib, self.logprob_gib, self.rollout_gib)


@dataclass(frozen=True)
class _Shares:
    """Parameter elements one GPU holds, split by how they are sharded for the optimizer."""

    dense: float  # sharded over the dense data-parallel group
    expert: float  # sharded over the expert data-parallel group
    layers: int  # transformer layers on this GPU's stage


@dataclass(frozen=True)
class ChunkShare:
    """Parameters of one model chunk on one rank: dense (non-expert) and expert elements."""

    dense: int
    expert: int


@dataclass(frozen=True)
class RankFigures:
    """The planner's parameters of one rank of a pipeline stage, per model chunk (VPP), and what they cost."""

    chunks: tuple[ChunkShare, ...]
    layers: int

    @property
    def dense(self) -> int:
        return sum(c.dense for c in self.chunks)

    @property
    def expert(self) -> int:
        return sum(c.expert for c in self.chunks)

    @staticmethod
    def weight_bytes(params: int) -> int:
        return BF16_BYTES * params

    @staticmethod
    def grad_bytes(params: int) -> int:
        return MEGATRON_GRAD_BYTES * params

    @staticmethod
    def optimizer_share(params: int, dp: int) -> int:
        """Elements of ``params`` one rank's distributed-optimizer shard holds (unpadded, rounded down)."""
        return params // max(dp, 1)


def megatron_rank_figures(m: ModelShape, lay: Layout, pp_rank: int) -> RankFigures:
    """Parameters a rank of pipeline stage ``pp_rank`` holds, per model chunk.

    Chunk v of stage p holds layers [(v·PP + p)·n, (v·PP + p + 1)·n), n = L / (PP·VPP) (megatron's interleaved
    assignment; VPP = 1 without it). The projections and dense MLPs are split over TP, norms and routers are not
    (:meth:`ModelShape.layer_params_on_tp_rank`); experts are split over EP·ETP. The embedding is on the first chunk
    of the first stage, the output layer and final norm on the last chunk of the last stage; with tied embeddings
    and PP > 1 the last stage holds its own copy of the output weight (megatron's shared-embedding rule). Exact when
    the layers divide PP·VPP and every layer has the same kind (dense or MoE); otherwise the layer terms are averaged
    and rounded.
    """
    vpp = lay.vpp or 1
    per_chunk = m.num_layers / (lay.pp * vpp)
    dense_layer = m.layer_params_on_tp_rank(lay.tp)
    expert_layer = m.total_expert_params / m.num_layers / (lay.ep * lay.etp)
    chunks = []
    for v in range(vpp):
        dense = per_chunk * dense_layer
        if pp_rank == 0 and v == 0:
            dense += m.embedding_params / lay.tp
        if pp_rank == lay.pp - 1 and v == vpp - 1:
            own_output = not m.tie_word_embeddings or lay.pp > 1
            output_weight = m.vocab_size * m.hidden_size if own_output else 0
            dense += output_weight / lay.tp + m.hidden_size  # the final norm is replicated over TP
        chunks.append(ChunkShare(dense=round(dense), expert=round(per_chunk * expert_layer)))
    return RankFigures(chunks=tuple(chunks), layers=math.ceil(m.num_layers / lay.pp))


def _megatron_shares(m: ModelShape, lay: Layout) -> _Shares:
    """The most loaded pipeline stage (most parameters) of :func:`megatron_rank_figures`."""
    stages = [megatron_rank_figures(m, lay, p) for p in range(lay.pp)]
    worst = max(stages, key=lambda s: s.dense + s.expert)
    return _Shares(dense=worst.dense, expert=worst.expert, layers=worst.layers)


def _activation_elems_per_token(m: ModelShape, tp: int, etp: int, sp_div: int) -> tuple[float, float]:
    """(per-layer bf16 elements per token averaged over MoE/dense layers, checkpoint input elements per token)."""
    h, d = m.hidden_size, m.head_dim
    attn = 2 * h / sp_div + (m.num_attention_heads + 2 * m.num_kv_heads) * d / tp + m.num_attention_heads * d / tp
    moe = 2 * h / sp_div + 4 * m.num_experts + m.moe_topk * (h + 3 * m.moe_ffn_hidden_size) / etp
    dense = 2 * h / sp_div + 3 * m.ffn_hidden_size / tp
    mlp = (m.num_moe_layers * moe + m.num_dense_layers * dense) / m.num_layers
    return attn + mlp, h / sp_div


def _recomputed_activation_bytes(lay: Layout, layers: int, per_layer: float, checkpoint: float) -> float:
    """Activations of one micro-batch on one stage under the configured recompute (bytes)."""
    if lay.recompute_granularity == "full":
        n = max(1, lay.recompute_num_layers or 1)
        if lay.recompute_method == "block":
            n = min(n, layers)
            return n * checkpoint + (layers - n) * per_layer + per_layer
        return math.ceil(layers / n) * checkpoint + min(n, layers) * per_layer
    return layers * per_layer


def estimate_memory(m: ModelShape, lay: Layout, gpu_gib: float, host_gib: float = 0.0) -> MemoryEstimate:
    """Estimate per-GPU memory of ``lay`` running model ``m`` on GPUs with ``gpu_gib`` GiB each.

    Assumes the layout divides (check the rules first); divisions that do not are rounded up.
    """
    tokens = lay.ppo_max_token_len_per_gpu  # per GPU and micro-batch: verl packs budget x seq_split tokens
    infer_tokens = lay.log_prob_max_token_len_per_gpu
    if lay.backend == "megatron":
        shares = _megatron_shares(m, lay)
        params = shares.dense + shares.expert
        weights = BF16_BYTES * params
        grads = MEGATRON_GRAD_BYTES * params
        if lay.distributed_optimizer:
            opt_params = shares.dense / max(lay.dp, 1) + shares.expert / max(lay.expert_dp, 1)
        else:
            opt_params = params
        frac = lay.optimizer_cpu_offload_fraction if lay.optimizer_cpu_offload else 0.0
        # The DistributedOptimizer keeps fp32 main parameters on the GPU unless the precision-aware optimizer
        # hands the bf16 shards to the (hybrid) optimizer, which then keeps its fp32 copy where it steps.
        main_on_gpu = (1.0 - frac) + (0.0 if lay.precision_aware_optimizer else frac)
        main_params = MEGATRON_MAIN_PARAM_BYTES * opt_params * main_on_gpu
        optimizer = main_params + MEGATRON_MOMENT_BYTES * opt_params * (1.0 - frac)
        cpu_opt = MEGATRON_CPU_OPTIMIZER_HOST_BYTES * opt_params * frac
        # After init (before the first step) only the main parameters exist; Adam's moments are created lazily.
        startup_opt = main_params
        sp_div = lay.tp if lay.sequence_parallel else 1
        per_layer, ckpt = _activation_elems_per_token(m, lay.tp, lay.etp, sp_div)
        act_one = _recomputed_activation_bytes(
            lay, shares.layers, BF16_BYTES * tokens * per_layer, BF16_BYTES * tokens * ckpt
        )
        activations = act_one * lay.pp  # 1F1B: the first stage holds PP micro-batches in flight
        vocab_shard = m.vocab_size / lay.tp
        logits = tokens * vocab_shard * LOGITS_TRAIN_BYTES
        infer_act = BF16_BYTES * infer_tokens * per_layer
        infer_logits = infer_tokens * vocab_shard * LOGITS_FORWARD_BYTES
    else:
        shard = max(1, lay.world if lay.fsdp_size in (-1, 0) else lay.fsdp_size)
        total = m.total_params
        params = total / shard
        layer_params = m.attention_params_per_layer + (
            m.dense_mlp_params if not m.is_moe else m.router_params + m.num_experts * m.expert_params
        )
        gathered = BF16_BYTES * (FSDP_GATHERED_LAYERS * layer_params + m.embedding_params)
        dtype_bytes = FSDP_DTYPE_BYTES.get(str(lay.model_dtype).lower(), FSDP_PARAM_BYTES)
        weights = dtype_bytes * params + gathered
        grads = dtype_bytes * params
        optimizer = (FSDP_STATE_COPIES - 1) * dtype_bytes * params
        cpu_opt = 0.0
        startup_opt = 0.0  # gradients and AdamW state are created at the first backward / step
        per_layer, ckpt = _activation_elems_per_token(m, 1, 1, 1)
        per_layer_bytes = BF16_BYTES * tokens * per_layer
        if lay.gradient_checkpointing:
            activations = m.num_layers * BF16_BYTES * tokens * ckpt + per_layer_bytes
        else:
            activations = m.num_layers * per_layer_bytes
        logits = tokens * m.vocab_size * LOGITS_TRAIN_BYTES
        infer_act = BF16_BYTES * infer_tokens * per_layer
        infer_logits = infer_tokens * m.vocab_size * LOGITS_FORWARD_BYTES
    reserve = RUNTIME_RESERVE_GIB * GIB
    train = weights + grads + optimizer + activations + logits + reserve
    resident_opt = 0.0 if lay.optimizer_offload else optimizer
    logprob = weights + grads + resident_opt + infer_act + infer_logits + reserve

    # Rollout: vLLM's share, and what the trainer keeps on the GPU next to it.
    rollout_shards = lay.rollout_tp * lay.rollout_pp
    rollout_weights = BF16_BYTES * m.total_params / rollout_shards
    kv_heads_per_rank = max(1.0, m.num_kv_heads / lay.rollout_tp)  # vLLM replicates KV heads when TP > n_kv
    kv_per_token = 2 * math.ceil(m.num_layers / lay.rollout_pp) * kv_heads_per_rank * m.head_dim * BF16_BYTES
    vllm_budget = lay.rollout_memory_fraction * gpu_gib * GIB
    kv = max(0.0, vllm_budget - rollout_weights - VLLM_OVERHEAD_GIB * GIB)
    resident = (0.0 if lay.param_offload else weights + grads) + resident_opt
    # Host RAM the offloads need on one node: the CPU optimizer, plus what leaves the GPU during rollout (verl
    # copies the bf16 weights to the host and frees the gradient buffers without a copy).
    host = cpu_opt + (weights if lay.param_offload else 0.0) + (optimizer if lay.optimizer_offload else 0.0)
    rollout = vllm_budget + resident + reserve
    # What vLLM's start-up check sees: the trainer after init, before any step (FSDP allocates gradients lazily).
    startup_grads = grads if lay.backend == "megatron" else 0.0
    startup_resident = (0.0 if lay.param_offload else weights + startup_grads) + (
        0.0 if lay.optimizer_offload else startup_opt
    )
    startup_free = gpu_gib * GIB - startup_resident - reserve

    # Routes of a step (R3's unless R2 is on): verl's TransferQueue holds each sample at its own length, so this
    # is the most a step carries, every sample at prompt_length + response_length.
    replay_step = replay_mb = replay_sample = 0.0
    index_bytes = route_index_bytes(m.num_experts, lay.replay) if m.is_moe else 0
    if m.is_moe:
        per_token = m.num_moe_layers * m.moe_topk * index_bytes
        replay_sample = lay.seq_len * per_token
        replay_step = lay.train_batch_size * lay.rollout_n * replay_sample
        replay_mb = tokens * lay.seq_split * per_token
    return MemoryEstimate(
        params_per_gpu=int(params),
        weights_gib=weights / GIB,
        grads_gib=grads / GIB,
        optimizer_gib=optimizer / GIB,
        activations_gib=activations / GIB,
        logits_gib=logits / GIB,
        reserve_gib=RUNTIME_RESERVE_GIB,
        train_gib=train / GIB,
        logprob_gib=logprob / GIB,
        rollout_weights_gib=rollout_weights / GIB,
        rollout_kv_gib=kv / GIB,
        rollout_kv_tokens=int(kv // kv_per_token),
        rollout_resident_gib=resident / GIB,
        rollout_gib=rollout / GIB,
        cpu_optimizer_gib=cpu_opt / GIB,
        replay_step_gib=replay_step / GIB,
        replay_microbatch_mib=replay_mb / 2**20,
        host_offload_gib_per_node=host * lay.gpus_per_node / GIB,
        gpu_gib=gpu_gib,
        rollout_startup_resident_gib=startup_resident / GIB,
        rollout_startup_free_gib=startup_free / GIB,
        rollout_startup_needed_gib=vllm_budget / GIB,
        replay_index_bytes=index_bytes,
        replay_sample_mib=replay_sample / 2**20,
        object_store_gib=object_store_gib(host_gib) if host_gib else 0.0,
    )


def memory_violations(lay: Layout, mem: MemoryEstimate) -> list[Violation]:
    """Every phase of the estimate that does not fit the GPU (the planner's rules next to the layout rules)."""
    out: list[Violation] = []
    cap = mem.gpu_gib
    if mem.train_gib > cap:
        out.append(
            Violation(
                "memory-train",
                f"training step needs ~{mem.train_gib:.1f} GiB per GPU > {cap:.1f} GiB (static "
                f"{mem.static_gib:.1f}, activations {mem.activations_gib:.1f}, logits "
                f"{mem.logits_gib:.1f}); lower ppo_max_token_len_per_gpu, recompute more, add GPUs or "
                f"megatron's CPU optimizer",
            )
        )
    if mem.logprob_gib > cap:
        out.append(
            Violation(
                "memory-logprob",
                f"old-log-prob forward needs ~{mem.logprob_gib:.1f} GiB per GPU > {cap:.1f} GiB; lower "
                f"rollout.log_prob_max_token_len_per_gpu",
            )
        )
    if mem.rollout_gib > cap:
        out.append(
            Violation(
                "memory-rollout",
                f"rollout needs ~{mem.rollout_gib:.1f} GiB per GPU (vLLM "
                f"{lay.rollout_memory_fraction:.2f} × {cap:.1f} + trainer resident "
                f"{mem.rollout_resident_gib:.1f} + reserve) > {cap:.1f} GiB; offload params/optimizer or "
                f"lower gpu_memory_utilization",
            )
        )
    if mem.rollout_startup_free_gib < mem.rollout_startup_needed_gib:
        out.append(
            Violation(
                "rollout-startup",
                f"vLLM will refuse to start: ~{mem.rollout_startup_free_gib:.1f} GiB free per GPU when it starts "
                f"(the trainer, built first by verl, holds ~{mem.rollout_startup_resident_gib:.1f} GiB + reserve) "
                f"< gpu_memory_utilization {lay.rollout_memory_fraction:.2f} × {cap:.1f} = "
                f"{mem.rollout_startup_needed_gib:.1f} GiB (vLLM Worker.init_device); offload params/optimizer "
                f"or lower gpu_memory_utilization",
            )
        )
    if lay.replay == "r3" and mem.object_store_gib and mem.replay_step_gib > mem.object_store_gib:
        out.append(
            Violation(
                "routing-replay-host",
                f"R3's routes of one step, up to {mem.replay_step_gib:.1f} GiB, exceed Ray's default object store "
                f"of the TaskRunner's node ({mem.object_store_gib:.1f} GiB: {RAY_OBJECT_STORE_SHARE:.0%} of its "
                f"memory, at most 200 GB); lower data.train_batch_size or data.max_response_length",
            )
        )
    if mem.rollout_kv_tokens < lay.seq_len:
        out.append(
            Violation(
                "rollout-kv",
                f"vLLM KV cache holds ~{mem.rollout_kv_tokens} tokens, less than one sequence of "
                f"{lay.seq_len}; raise gpu_memory_utilization or rollout TP",
            )
        )
    return out
