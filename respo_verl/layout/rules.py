"""The layout rules megatron-core, vLLM and verl enforce at start-up, checked before anything starts.

Each rule has a stable id (used in messages and tests) and names the config keys involved. Where the enforcing
code lives is given so a rule can be re-checked against a new version. A rule that needs the model's shape (heads,
layers, experts) is checked only when the shape is known; the others need the layout alone. Whether the job fits
in memory is the planner's question (:mod:`respo_verl.tools.plan.memory`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from respo_verl.layout.models import ModelShape
from respo_verl.layout.parallel import COMMON_KEYS, FSDP_KEYS, MEGATRON_KEYS, ROLLOUT, Layout
from respo_verl.layout.parallel import MEGATRON as MG
from respo_verl.routing.mode import REPLAY_KEY, verl_mode

DISPATCHERS = ("allgather", "alltoall", "flex")
RECOMPUTE_METHODS = ("uniform", "block")
# The Layout fields of counts that must be at least 1 (size_violations), named by their keys in the job.
SIZES = (
    *("nnodes", "gpus_per_node", "train_batch_size", "ppo_mini_batch_size", "rollout_n", "rollout_tp", "rollout_dp"),
    *("rollout_pp", "rollout_ep", "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"),
)
MEGATRON_SIZES = ("tp", "pp", "cp", "ep", "etp", "vpp")


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


def reuse_violation(train_batch_size: int, mini_batch_size: int) -> Violation | None:
    """``batch-mini``: a rollout batch that is not a whole number of mini-batches, so that N (optimizer updates per
    rollout batch) is not an integer; verl would drop the remainder (``DataProto.split``)."""
    train, mini = train_batch_size, mini_batch_size
    if mini >= 1 and train % mini == 0:
        return None
    return Violation(
        "batch-mini",
        f"data.train_batch_size={train} is not a whole number of mini-batches of "
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} (N = {train / max(mini, 1):g}): make it a multiple",
    )


def reuse_of(train_batch_size: int, mini_batch_size: int) -> int:
    """N, the optimizer updates per rollout batch; ValueError with the ``batch-mini`` message where it is no integer."""
    if violation := reuse_violation(int(train_batch_size), int(mini_batch_size)):
        raise ValueError(violation.message)
    return int(train_batch_size) // int(mini_batch_size)


def replay_violation(m: ModelShape, replay: str) -> Violation | None:
    """``router-replay``: routing replay (``off``, ``r2``, ``r3``) on a model without routed experts, which megatron
    would start and then fail on at the first replayed forward."""
    if replay == "off" or m.is_moe:
        return None
    return Violation(
        "router-replay",
        f"{REPLAY_KEY}={verl_mode(replay)} (routing replay) needs an MoE model; {m.name} is dense "
        f"(model_type {m.model_type!r})",
    )


def size_violations(lay: Layout) -> list[Violation]:
    """Counts that must be positive before any other rule (or the memory model) can divide by them."""
    names = (*SIZES, *(MEGATRON_SIZES if lay.backend == "megatron" else ("ulysses_sp",)))
    keys = {**COMMON_KEYS, **(MEGATRON_KEYS if lay.backend == "megatron" else FSDP_KEYS)}
    sizes = {keys[name]: getattr(lay, name) for name in names if getattr(lay, name) is not None}
    out = [Violation("world-size", f"{key} must be >= 1, got {value}") for key, value in sizes.items() if value < 1]
    if lay.nnodes >= 1 and lay.gpus_per_node >= 1:
        return out
    return [
        Violation(
            "world-size",
            f"trainer.nnodes × trainer.n_gpus_per_node = {lay.nnodes}×{lay.gpus_per_node} = {lay.world} GPUs; "
            f"a job needs at least one node with at least one GPU",
        ),
        *(v for v in out if not v.message.startswith("trainer.")),
    ]


def _megatron_rules(m: ModelShape | None, lay: Layout) -> Iterator[Violation]:
    grid = lay.tp * lay.pp * lay.cp
    if lay.world % grid:
        yield Violation(
            "world-grid",
            f"world {lay.world} is not divisible by TP·PP·CP = {lay.tp}·{lay.pp}·{lay.cp} = {grid} "
            f"(megatron initialize_model_parallel; {MG}.tensor/pipeline/context_parallel_size)",
        )
    egrid = lay.etp * lay.ep * lay.pp
    if lay.world % egrid:
        yield Violation(
            "expert-grid",
            f"expert grid ETP·EP·PP = {lay.etp}·{lay.ep}·{lay.pp} = {egrid} does not divide the world "
            f"{lay.world} (megatron initialize_model_parallel; {MG}.expert_tensor_parallel_size "
            f"defaults to TP when null)",
        )
    if m is not None and m.is_moe and m.num_experts % lay.ep:
        yield Violation(
            "experts-ep",
            f"{m.num_experts} experts are not divisible by EP = {lay.ep} ({MG}.expert_model_parallel_size)",
        )
    if m is not None and not m.is_moe and lay.ep > 1:
        yield Violation("experts-ep", f"EP = {lay.ep} but {m.name} has no experts")
    vpp = lay.vpp or 1
    if lay.vpp is not None and lay.pp == 1:
        yield Violation(
            "vpp-needs-pp",
            f"virtual pipeline size {lay.vpp} needs PP > 1 ({MG}.virtual_pipeline_model_parallel_size)",
        )
    if lay.pp == 2 and vpp > 1 and lay.overlap_p2p_comm is False:
        yield Violation(
            "pp2-vpp-p2p",
            f"PP = 2 with VPP = {vpp} and {MG}.override_transformer_config.overlap_p2p_comm=false: under verl's "
            "variable_seq_lengths, megatron-core 0.16.1 exchanges activation and gradient shapes to the one peer "
            "in one call and crosses them (NVIDIA/Megatron-LM#5100); leave overlap_p2p_comm unset (verl sets it "
            "true with VPP > 1)",
        )
    if m is not None and m.num_layers % (lay.pp * vpp):
        yield Violation(
            "layers-pp",
            f"{m.num_layers} layers are not divisible by PP·VPP = {lay.pp}·{vpp} (megatron TransformerConfig)",
        )
    if m is not None and m.num_attention_heads % lay.tp:
        yield Violation("heads-tp", f"{m.num_attention_heads} attention heads are not divisible by TP = {lay.tp}")
    if m is not None and m.num_kv_heads % lay.tp and lay.tp % m.num_kv_heads:
        yield Violation(
            "kv-groups-tp",
            f"{m.num_kv_heads} KV groups must be a multiple or a divisor of TP = {lay.tp} (megatron TransformerConfig)",
        )
    # EP > 1 makes megatron build MoE layers: a dense model is refused above, an unknown one is taken as MoE.
    if (m is None or m.is_moe) and lay.ep > 1 and lay.tp > 1 and not lay.sequence_parallel:
        yield Violation(
            "moe-sequence-parallel",
            f"EP > 1 with TP > 1 needs sequence parallelism ({MG}.sequence_parallel=true; megatron "
            f"ModelParallelConfig)",
        )
    if lay.recompute_granularity not in (None, "full", "selective"):
        yield Violation(
            "recompute",
            f"recompute_granularity {lay.recompute_granularity!r} must be full, selective or null",
        )
    if lay.recompute_granularity == "full":
        if lay.recompute_method not in RECOMPUTE_METHODS:
            yield Violation(
                "recompute",
                f"recompute_granularity=full needs recompute_method uniform or block, got "
                f"{lay.recompute_method!r} ({MG}.override_transformer_config)",
            )
        per_stage = m.num_layers // (lay.pp * vpp) if m is not None and m.num_layers % (lay.pp * vpp) == 0 else None
        n = lay.recompute_num_layers
        if n is None or n < 1 or (per_stage is not None and n > per_stage):
            bound = f"[1, {per_stage}]" if per_stage is not None else ">= 1"
            yield Violation(
                "recompute",
                f"recompute_num_layers must be {'in ' if per_stage is not None else ''}{bound} with full "
                f"recompute, got {n}",
            )
    if lay.recompute_granularity == "selective" and lay.recompute_num_layers is not None:
        yield Violation(
            "recompute", "recompute_num_layers must be null with selective recompute (megatron TransformerConfig)"
        )
    if lay.moe_dispatcher is not None and lay.moe_dispatcher not in DISPATCHERS:
        yield Violation(
            "moe-dispatcher",
            f"moe_token_dispatcher_type {lay.moe_dispatcher!r} must be one of {', '.join(DISPATCHERS)}",
        )
    if lay.moe_router_dtype not in (None, "fp32", "fp64"):
        yield Violation("router-dtype", f"moe_router_dtype {lay.moe_router_dtype!r} must be fp32, fp64 or null")
    if not 0.0 <= lay.optimizer_cpu_offload_fraction <= 1.0:
        yield Violation(
            "optimizer-offload",
            f"optimizer_offload_fraction {lay.optimizer_cpu_offload_fraction} must be in [0, 1]",
        )
    if lay.optimizer_cpu_offload and not lay.precision_aware_optimizer:
        yield Violation(
            "optimizer-cpu-offload",
            "optimizer_cpu_offload needs use_precision_aware_optimizer=true (megatron-LM's argument check; "
            "without it the fp32 main parameters stay on the GPU next to the CPU optimizer's own copy); set "
            "actor_rollout_ref.actor.optim.use_precision_aware_optimizer=true",
        )
    if m is not None and (violation := replay_violation(m, lay.replay)):
        yield violation


def _fsdp_rules(m: ModelShape | None, lay: Layout) -> Iterator[Violation]:
    sp = lay.ulysses_sp
    if lay.world % sp:
        yield Violation("world-grid", f"world {lay.world} is not divisible by Ulysses SP = {sp}")
    if m is not None and m.num_attention_heads % sp:
        yield Violation(
            "heads-sp",
            f"{m.num_attention_heads} attention heads are not divisible by Ulysses SP = {sp}",
        )
    if m is not None and m.num_kv_heads % sp and sp % m.num_kv_heads:
        yield Violation(
            "kv-heads-sp",
            f"{m.num_kv_heads} KV heads must be a multiple or a divisor of Ulysses SP = {sp}",
        )
    if lay.fsdp_size not in (-1, 0) and lay.world % lay.fsdp_size:
        yield Violation("fsdp-size", f"fsdp_size {lay.fsdp_size} does not divide the world {lay.world}")
    if lay.tp != 1 or lay.ep != 1 or lay.pp != 1:
        yield Violation("fsdp-parallel", "the FSDP engine has no TP/EP/PP; use model_engine=megatron")


def _batch_rules(lay: Layout) -> Iterator[Violation]:
    dp = lay.dp
    if violation := reuse_violation(lay.train_batch_size, lay.ppo_mini_batch_size):
        yield violation
    mini = lay.ppo_mini_batch_size * lay.rollout_n
    if dp and mini % dp:
        yield Violation("batch-dp", f"ppo_mini_batch_size × n = {mini} responses do not split over DP = {dp}")
    if dp and (lay.train_batch_size * lay.rollout_n) % dp:
        yield Violation(
            "batch-dp",
            f"train_batch_size × n = {lay.train_batch_size * lay.rollout_n} responses do not split over DP = {dp}",
        )
    if not lay.use_dynamic_bsz:
        micro = lay.ppo_micro_batch_size_per_gpu
        if not micro:
            yield Violation("batch-micro", "use_dynamic_bsz=false needs actor.ppo_micro_batch_size_per_gpu")
        elif dp and (mini // dp) % micro:
            yield Violation(
                "batch-micro",
                f"{mini // dp} responses per DP rank per mini-batch are not a multiple of "
                f"ppo_micro_batch_size_per_gpu {micro}",
            )
    seq, split = lay.seq_len, lay.seq_split
    if lay.use_dynamic_bsz:
        for key, budget in (
            ("actor.ppo_max_token_len_per_gpu", lay.ppo_max_token_len_per_gpu),
            ("rollout.log_prob_max_token_len_per_gpu", lay.log_prob_max_token_len_per_gpu),
        ):
            if budget * split < seq:
                yield Violation(
                    "token-budget",
                    f"{key} = {budget} (× sequence split {split}) cannot hold one sequence of "
                    f"max_prompt_length + max_response_length = {seq} tokens (verl seqlen_balancing)",
                )


def _rollout_rules(m: ModelShape | None, lay: Layout) -> Iterator[Violation]:
    replica = lay.rollout_tp * lay.rollout_dp * lay.rollout_pp
    if lay.gpus_per_node % lay.rollout_tp or lay.rollout_tp > lay.gpus_per_node:
        yield Violation(
            "rollout-tp-node",
            f"rollout TP {lay.rollout_tp} does not divide the node ({lay.gpus_per_node} GPUs; "
            f"{ROLLOUT}.tensor_model_parallel_size)",
        )
    if lay.world % replica:
        yield Violation(
            "rollout-replicas",
            f"rollout replica TP·DP·PP = {replica} does not divide the world {lay.world} (verl llm_server)",
        )
    if lay.rollout_ep > 1 and lay.rollout_ep != lay.rollout_tp * lay.rollout_dp:
        yield Violation(
            "rollout-ep",
            f"rollout expert_parallel_size {lay.rollout_ep} must equal TP·DP = {lay.rollout_tp * lay.rollout_dp} "
            f"(verl RolloutConfig)",
        )
    if m is not None and m.num_attention_heads % lay.rollout_tp:
        yield Violation(
            "rollout-heads",
            f"{m.num_attention_heads} attention heads are not divisible by rollout TP {lay.rollout_tp} (vLLM)",
        )
    if m is not None and m.num_kv_heads % lay.rollout_tp and lay.rollout_tp % m.num_kv_heads:
        yield Violation(
            "rollout-heads",
            f"{m.num_kv_heads} KV heads must be a multiple or a divisor of rollout TP {lay.rollout_tp} (vLLM)",
        )
    if not 0.0 < lay.rollout_memory_fraction < 1.0:
        yield Violation(
            "rollout-memory",
            f"gpu_memory_utilization {lay.rollout_memory_fraction} must be in (0, 1)",
        )
    if lay.rollout_max_model_len is not None and lay.rollout_max_model_len < lay.seq_len:
        yield Violation(
            "rollout-max-len",
            f"{ROLLOUT}.max_model_len {lay.rollout_max_model_len} < prompt + response {lay.seq_len}",
        )


def check_layout(m: ModelShape | None, lay: Layout, batch: bool = True) -> list[Violation]:
    """Every violated layout rule (empty: megatron-core, vLLM and verl accept the layout).

    Args:
        m: the model's shape, or None where it is not known: the rules on heads, layers and experts are then left
            out, the rest still hold.
        lay: the job's layout (:func:`respo_verl.layout.parallel.layout_from_config`).
        batch: include the rules on how batches split (mini-batches, micro-batches, token budgets).

    A layout with a count below 1 (no GPUs, TP 0, ...) gets only the ``world-size`` violations: the other rules
    (and the planner's memory model) divide by those counts.
    """
    sizes = size_violations(lay)
    if sizes:
        return sizes
    rules = _megatron_rules(m, lay) if lay.backend == "megatron" else _fsdp_rules(m, lay)
    return [*rules, *(_batch_rules(lay) if batch else ()), *_rollout_rules(m, lay)]
