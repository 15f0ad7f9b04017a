"""The parallel layout of a composed verl job, read from the config keys verl 0.9.1 actually uses."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from respo_verl.routing.mode import replay_mode


class LayoutError(ValueError):
    """A layout key whose value is not of the kind verl reads (the message names the key)."""


@dataclass(frozen=True)
class Layout:
    """Everything the rules and the memory model read from a composed job config.

    Megatron fields are the actor's ``actor_rollout_ref.actor.megatron.*``; FSDP fields the actor's
    ``fsdp_config.*``. ``etp`` is already resolved (verl passes ``null`` to megatron, which then uses TP).
    """

    backend: str  # "megatron" or "fsdp"
    nnodes: int
    gpus_per_node: int
    # megatron
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    moe_dispatcher: str | None = None
    moe_router_dtype: str | None = None
    overlap_p2p_comm: bool | None = None  # None: verl's and mbridge's own choice, True when VPP > 1
    optimizer_cpu_offload: bool = False
    optimizer_cpu_offload_fraction: float = 0.0
    precision_aware_optimizer: bool = False
    # fsdp
    ulysses_sp: int = 1
    fsdp_size: int = -1
    model_dtype: str = "fp32"
    gradient_checkpointing: bool = True
    # both
    param_offload: bool = False
    optimizer_offload: bool = False
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    log_prob_max_token_len_per_gpu: int = 16384
    ppo_micro_batch_size_per_gpu: int | None = None
    # batch
    train_batch_size: int = 1
    ppo_mini_batch_size: int = 1
    rollout_n: int = 1
    max_prompt_length: int = 512
    max_response_length: int = 512
    # rollout (vLLM)
    rollout_tp: int = 1
    rollout_dp: int = 1
    rollout_pp: int = 1
    rollout_ep: int = 1
    rollout_memory_fraction: float = 0.5
    rollout_max_model_len: int | None = None
    rollout_max_num_seqs: int = 1024
    rollout_name: str | None = None
    free_cache_engine: bool = True
    replay: str = "off"  # routing replay: off, r2, r3 (respo_verl.routing.mode)

    @property
    def world(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense (non-expert) parameters; 0 when the world does not divide."""
        if self.backend == "fsdp":
            return self.world // self.ulysses_sp if self.world % self.ulysses_sp == 0 else 0
        grid = self.tp * self.pp * self.cp
        return self.world // grid if self.world % grid == 0 else 0

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert parameters (megatron's expert grid is ETP x EP x PP)."""
        grid = self.etp * self.ep * self.pp
        return self.world // grid if self.world % grid == 0 else 0

    @property
    def seq_len(self) -> int:
        return self.max_prompt_length + self.max_response_length

    @property
    def seq_split(self) -> int:
        """How many GPUs one packed micro-batch is split over along the sequence (verl's ``sp_size``)."""
        return self.cp if self.backend == "megatron" else self.ulysses_sp


def _get(cfg: DictConfig, key: str, default=None):
    try:
        value = OmegaConf.select(cfg, key, default=default)
    except OmegaConfBaseException as err:  # an interpolation that does not resolve
        raise LayoutError(f"{key}: {str(err).strip().splitlines()[0]}") from None
    return default if value is None else value


def _int(cfg: DictConfig, key: str, default: int) -> int:
    value = _get(cfg, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{key} must be an integer, got {value!r}")
    return value


def _opt_int(cfg: DictConfig, key: str) -> int | None:
    return None if _get(cfg, key) is None else _int(cfg, key, 0)


def _float(cfg: DictConfig, key: str, default: float) -> float:
    value = _get(cfg, key, default)
    if isinstance(value, bool):
        raise LayoutError(f"{key} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise LayoutError(f"{key} must be a number, got {value!r}") from None


def _bool(cfg: DictConfig, key: str, default: bool) -> bool:
    value = _get(cfg, key, default)
    if not isinstance(value, bool):
        raise LayoutError(f"{key} must be true or false, got {value!r}")
    return value


def _opt_bool(cfg: DictConfig, key: str) -> bool | None:
    return None if _get(cfg, key) is None else _bool(cfg, key, False)


def layout_from_config(cfg: DictConfig) -> Layout:
    """Read a :class:`Layout` from a composed (resolvable) job config."""
    actor = "actor_rollout_ref.actor"
    strategy = _get(cfg, f"{actor}.strategy", "fsdp")
    backend = "megatron" if strategy == "megatron" else "fsdp"
    common = dict(
        backend=backend,
        nnodes=_int(cfg, "trainer.nnodes", 1),
        gpus_per_node=_int(cfg, "trainer.n_gpus_per_node", 8),
        use_dynamic_bsz=_bool(cfg, f"{actor}.use_dynamic_bsz", False),
        ppo_max_token_len_per_gpu=_int(cfg, f"{actor}.ppo_max_token_len_per_gpu", 16384),
        log_prob_max_token_len_per_gpu=_int(cfg, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", 16384),
        ppo_micro_batch_size_per_gpu=_opt_int(cfg, f"{actor}.ppo_micro_batch_size_per_gpu"),
        train_batch_size=_int(cfg, "data.train_batch_size", 1),
        ppo_mini_batch_size=_int(cfg, f"{actor}.ppo_mini_batch_size", 1),
        rollout_n=_int(cfg, "actor_rollout_ref.rollout.n", 1),
        max_prompt_length=_int(cfg, "data.max_prompt_length", 512),
        max_response_length=_int(cfg, "data.max_response_length", 512),
        rollout_tp=_int(cfg, "actor_rollout_ref.rollout.tensor_model_parallel_size", 1),
        rollout_dp=_int(cfg, "actor_rollout_ref.rollout.data_parallel_size", 1),
        rollout_pp=_int(cfg, "actor_rollout_ref.rollout.pipeline_model_parallel_size", 1),
        rollout_ep=_int(cfg, "actor_rollout_ref.rollout.expert_parallel_size", 1),
        rollout_memory_fraction=_float(cfg, "actor_rollout_ref.rollout.gpu_memory_utilization", 0.5),
        rollout_max_model_len=_opt_int(cfg, "actor_rollout_ref.rollout.max_model_len"),
        rollout_max_num_seqs=_int(cfg, "actor_rollout_ref.rollout.max_num_seqs", 1024),
        rollout_name=_get(cfg, "actor_rollout_ref.rollout.name"),
        free_cache_engine=_bool(cfg, "actor_rollout_ref.rollout.free_cache_engine", True),
    )
    if backend == "megatron":
        mg = f"{actor}.megatron"
        tp = _int(cfg, f"{mg}.tensor_model_parallel_size", 1)
        tf = f"{mg}.override_transformer_config"
        offload_cfg = f"{actor}.optim.override_optimizer_config"
        cpu_offload = _bool(cfg, f"{offload_cfg}.optimizer_cpu_offload", False)
        return Layout(
            **common,
            tp=tp,
            pp=_int(cfg, f"{mg}.pipeline_model_parallel_size", 1),
            vpp=_opt_int(cfg, f"{mg}.virtual_pipeline_model_parallel_size"),
            cp=_int(cfg, f"{mg}.context_parallel_size", 1),
            ep=_int(cfg, f"{mg}.expert_model_parallel_size", 1),
            etp=_int(cfg, f"{mg}.expert_tensor_parallel_size", tp),
            # verl turns sequence parallelism off by itself when TP is 1 (McoreEngineConfig.__post_init__).
            sequence_parallel=_bool(cfg, f"{mg}.sequence_parallel", True) and tp > 1,
            distributed_optimizer=_bool(cfg, f"{mg}.use_distributed_optimizer", True),
            recompute_granularity=_get(cfg, f"{tf}.recompute_granularity"),
            recompute_method=_get(cfg, f"{tf}.recompute_method"),
            recompute_num_layers=_opt_int(cfg, f"{tf}.recompute_num_layers"),
            moe_dispatcher=_get(cfg, f"{tf}.moe_token_dispatcher_type"),
            moe_router_dtype=_get(cfg, f"{tf}.moe_router_dtype"),
            overlap_p2p_comm=_opt_bool(cfg, f"{tf}.overlap_p2p_comm"),
            optimizer_cpu_offload=cpu_offload,
            # verl copies override_optimizer_config over its own optim keys (utils/megatron/optimizer.py).
            precision_aware_optimizer=_bool(
                cfg,
                f"{offload_cfg}.use_precision_aware_optimizer",
                _bool(cfg, f"{actor}.optim.use_precision_aware_optimizer", False),
            ),
            optimizer_cpu_offload_fraction=(
                _float(cfg, f"{offload_cfg}.optimizer_offload_fraction", 0.0) if cpu_offload else 0.0
            ),
            param_offload=_bool(cfg, f"{mg}.param_offload", False),
            optimizer_offload=_bool(cfg, f"{mg}.optimizer_offload", False),
            replay=replay_mode(cfg),
        )
    fs = f"{actor}.fsdp_config"
    sp = _int(cfg, f"{fs}.ulysses_sequence_parallel_size", 1)
    sp = max(sp, _int(cfg, f"{actor}.ulysses_sequence_parallel_size", 1))  # verl forwards the deprecated key
    return Layout(
        **common,
        ulysses_sp=sp,
        fsdp_size=_int(cfg, f"{fs}.fsdp_size", -1),
        model_dtype=str(_get(cfg, f"{fs}.model_dtype", "fp32")),
        gradient_checkpointing=_bool(cfg, "actor_rollout_ref.model.enable_gradient_checkpointing", True),
        param_offload=_bool(cfg, f"{fs}.param_offload", False),
        optimizer_offload=_bool(cfg, f"{fs}.optimizer_offload", False),
    )
