"""The parallel layout of a composed verl job, read from the config keys verl 0.9.1 actually uses."""

from __future__ import annotations

from dataclasses import dataclass, fields

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


ACTOR = "actor_rollout_ref.actor"
# The one key that decides the engine (Layout.backend): verl's workers hand it to verl's engine registry and read it
# to switch routing replay on; model_engine only selects the config group that sets it.
STRATEGY = f"{ACTOR}.strategy"
MEGATRON = f"{ACTOR}.megatron"
TRANSFORMER = f"{MEGATRON}.override_transformer_config"
OPTIMIZER = f"{ACTOR}.optim.override_optimizer_config"  # verl copies it over its own optim keys (optimizer.py)
FSDP = f"{ACTOR}.fsdp_config"
ROLLOUT = "actor_rollout_ref.rollout"
# Layout field <- the job's key. Each is read as the field's type (Layout's annotations); a key the job leaves
# unset or null keeps the field's default, so that no default of verl's is written twice.
COMMON_KEYS = {
    "nnodes": "trainer.nnodes",
    "gpus_per_node": "trainer.n_gpus_per_node",
    "use_dynamic_bsz": f"{ACTOR}.use_dynamic_bsz",
    "ppo_max_token_len_per_gpu": f"{ACTOR}.ppo_max_token_len_per_gpu",
    "log_prob_max_token_len_per_gpu": f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
    "ppo_micro_batch_size_per_gpu": f"{ACTOR}.ppo_micro_batch_size_per_gpu",
    "train_batch_size": "data.train_batch_size",
    "ppo_mini_batch_size": f"{ACTOR}.ppo_mini_batch_size",
    "rollout_n": f"{ROLLOUT}.n",
    "max_prompt_length": "data.max_prompt_length",
    "max_response_length": "data.max_response_length",
    "rollout_tp": f"{ROLLOUT}.tensor_model_parallel_size",
    "rollout_dp": f"{ROLLOUT}.data_parallel_size",
    "rollout_pp": f"{ROLLOUT}.pipeline_model_parallel_size",
    "rollout_ep": f"{ROLLOUT}.expert_parallel_size",
    "rollout_memory_fraction": f"{ROLLOUT}.gpu_memory_utilization",
    "rollout_max_model_len": f"{ROLLOUT}.max_model_len",
    "rollout_max_num_seqs": f"{ROLLOUT}.max_num_seqs",
    "rollout_name": f"{ROLLOUT}.name",
    "free_cache_engine": f"{ROLLOUT}.free_cache_engine",
}
MEGATRON_KEYS = {
    "tp": f"{MEGATRON}.tensor_model_parallel_size",
    "pp": f"{MEGATRON}.pipeline_model_parallel_size",
    "vpp": f"{MEGATRON}.virtual_pipeline_model_parallel_size",
    "cp": f"{MEGATRON}.context_parallel_size",
    "ep": f"{MEGATRON}.expert_model_parallel_size",
    "etp": f"{MEGATRON}.expert_tensor_parallel_size",
    "sequence_parallel": f"{MEGATRON}.sequence_parallel",
    "distributed_optimizer": f"{MEGATRON}.use_distributed_optimizer",
    "recompute_granularity": f"{TRANSFORMER}.recompute_granularity",
    "recompute_method": f"{TRANSFORMER}.recompute_method",
    "recompute_num_layers": f"{TRANSFORMER}.recompute_num_layers",
    "moe_dispatcher": f"{TRANSFORMER}.moe_token_dispatcher_type",
    "moe_router_dtype": f"{TRANSFORMER}.moe_router_dtype",
    "overlap_p2p_comm": f"{TRANSFORMER}.overlap_p2p_comm",
    "optimizer_cpu_offload": f"{OPTIMIZER}.optimizer_cpu_offload",
    "optimizer_cpu_offload_fraction": f"{OPTIMIZER}.optimizer_offload_fraction",
    "precision_aware_optimizer": f"{ACTOR}.optim.use_precision_aware_optimizer",
    "param_offload": f"{MEGATRON}.param_offload",
    "optimizer_offload": f"{MEGATRON}.optimizer_offload",
}
FSDP_KEYS = {
    "ulysses_sp": f"{FSDP}.ulysses_sequence_parallel_size",
    "fsdp_size": f"{FSDP}.fsdp_size",
    "model_dtype": f"{FSDP}.model_dtype",
    "gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
    "param_offload": f"{FSDP}.param_offload",
    "optimizer_offload": f"{FSDP}.optimizer_offload",
}
_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _read(cfg: DictConfig, key: str, kind: str):
    """The value of ``key`` as ``kind`` (a Layout annotation: ``int``, ``float | None``, ...), or None where the job
    leaves it unset or null. Raises :class:`LayoutError` naming the key."""
    try:
        value = OmegaConf.select(cfg, key, default=None)
    except OmegaConfBaseException as err:  # an interpolation that does not resolve
        raise LayoutError(f"{key}: {str(err).strip().splitlines()[0]}") from None
    base = kind.split(" | ")[0]
    if value is None or base == "str":
        return None if value is None else str(value)
    if isinstance(value, bool) != (base == "bool") or not isinstance(value, int | float):
        raise LayoutError(f"{key} must be {_KINDS[base]}, got {value!r}")
    if base == "int" and not isinstance(value, int):
        raise LayoutError(f"{key} must be an integer, got {value!r}")
    return float(value) if base == "float" else value


def _read_all(cfg: DictConfig, keys: dict[str, str]) -> dict:
    kinds = {f.name: f.type for f in fields(Layout)}
    values = {name: _read(cfg, key, kinds[name]) for name, key in keys.items()}
    return {name: value for name, value in values.items() if value is not None or "None" in kinds[name]}


def layout_from_config(cfg: DictConfig) -> Layout:
    """Read a :class:`Layout` from a composed (resolvable) job config."""
    backend = "megatron" if _read(cfg, STRATEGY, "str") == "megatron" else "fsdp"  # fsdp: any engine but Megatron
    common = _read_all(cfg, COMMON_KEYS)
    if backend == "fsdp":
        fsdp = _read_all(cfg, FSDP_KEYS)
        deprecated = _read(cfg, f"{ACTOR}.ulysses_sequence_parallel_size", "int")  # verl forwards the old key
        fsdp["ulysses_sp"] = max(fsdp.get("ulysses_sp", 1), 1 if deprecated is None else deprecated)
        return Layout(backend=backend, **common, **fsdp)
    mg = _read_all(cfg, MEGATRON_KEYS)
    tp = mg.get("tp", 1)
    mg.setdefault("etp", tp)  # verl passes null to megatron, which then uses TP
    # verl turns sequence parallelism off by itself when TP is 1 (McoreEngineConfig.__post_init__).
    mg["sequence_parallel"] = mg.get("sequence_parallel", True) and tp > 1
    precision_aware = _read(cfg, f"{OPTIMIZER}.use_precision_aware_optimizer", "bool")
    if precision_aware is not None:  # the override wins over the optim key
        mg["precision_aware_optimizer"] = precision_aware
    if not mg.get("optimizer_cpu_offload", False):
        mg["optimizer_cpu_offload_fraction"] = 0.0
    return Layout(backend=backend, **common, **mg, replay=replay_mode(cfg))
