"""verl 0.9.1's Megatron engine on the CPU platform: registration, fp32 parameters, and the CPU stand-ins it needs.

- verl version: 0.9.1 (with megatron-core 0.16.1 and mbridge 0.15.1).
- Why: verl registers its Megatron engines for ``cuda`` and ``npu`` only
  (``verl/workers/engine/megatron/transformer_impl.py``, ``@EngineRegistry.register(..., backend="megatron")``), and
  ``McoreEngineConfig.__post_init__`` (``verl/workers/config/engine.py``) accepts ``dtype`` bfloat16 or float16 only.
  With bf16 parameters megatron-core wraps Adam in ``Float16OptimizerWithFloat16Params``, which accepts parameters
  by their CUDA type name only (``megatron/core/optimizer/optimizer.py``: ``param.type() in
  ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']``, else ``TypeError``), so a CPU run needs fp32 parameters
  (megatron-core's ``FP32Optimizer``); fp32 is also what makes the rollout's and the trainer's log-probs comparable.
  Beyond verl, the engine needs megatron-core's CPU stand-ins
  (:mod:`respo_verl.megatron.patches.megatron_core_0_16_1_cpu`) and mbridge on megatron-core's local layers
  (:mod:`respo_verl.megatron.patches.mbridge_0_15_1_cpu`).
- What :func:`apply` does, once per process: ``McoreEngineConfig`` accepts ``dtype`` fp32/float32 (verl's own check
  runs on every other value); and when verl's Megatron engine module is imported (worker processes only; the driver
  never builds an engine), it registers ``MegatronEngineWithLMHead`` / ``MegatronEngineWithValueHead`` for device
  ``cpu`` through the public ``EngineRegistry``, and ``MegatronEngine.__init__`` applies the megatron-core and mbridge
  CPU patches before verl's own code runs (so a worker that never builds a Megatron engine is left alone); the
  engine's ``load_megatron_model_to_gpu`` / ``offload_megatron_model_to_cpu`` become a check that every parameter
  is on the host (see :func:`_parameters_stay_on_the_host`: megatron-core's parameter buffer exists only with the
  distributed optimizer, which takes CUDA tensors only); the padding mask of verl's bshd forward becomes the causal
  mask megatron-core's local attention needs (:func:`local_attention_mask`); verl's R2 record/replay gets the
  padded batch's route layout (:func:`_replay_on_padded_batches`); and the weights the engine hands to the
  rollout for syncing go through :func:`fuse_expert_weights` (mbridge exports the checkpoint's per-expert layout,
  the hf_cpu rollout server holds transformers 5's fused expert tensors).
- Applied by :mod:`respo_verl.verl.cpu` (the CPU presets), never on import of respo_verl.
- Delete when: verl registers its Megatron engine for a CPU platform and accepts fp32, and megatron-core and mbridge
  run without Transformer Engine and CUDA.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterable, Iterator

import torch

MEGATRON_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
# PrecisionType's names of float32 (verl/utils/torch_dtypes.py FLOAT_LIST, the strings).
FP32_NAMES = ("fp32", "float32", "32")
# A dtype verl's own check accepts, stood in while it runs on an fp32 config.
_CHECKED_DTYPE = "bfloat16"
_ORIGINAL_ATTR = "__respo_original__"

_applied = False


def _accept_fp32() -> None:
    from verl.workers.config.engine import McoreEngineConfig

    original = vars(McoreEngineConfig)["__post_init__"]
    if hasattr(original, _ORIGINAL_ATTR):
        return

    @functools.wraps(original)
    def __post_init__(self) -> None:
        if str(self.dtype) not in FP32_NAMES:
            return original(self)
        dtype = self.dtype
        object.__setattr__(self, "dtype", _CHECKED_DTYPE)  # the field is frozen (verl's BaseConfig)
        try:
            original(self)
        finally:
            object.__setattr__(self, "dtype", dtype)

    setattr(__post_init__, _ORIGINAL_ATTR, original)
    McoreEngineConfig.__post_init__ = __post_init__


def _patch_dependencies() -> None:
    from respo_verl.megatron.patches import mbridge_0_15_1_cpu, megatron_core_0_16_1_cpu

    megatron_core_0_16_1_cpu.apply()
    mbridge_0_15_1_cpu.apply()


def _parameters_stay_on_the_host(models, *args, **kwargs) -> None:
    """verl's ``load_megatron_model_to_gpu`` / ``offload_megatron_model_to_cpu`` on the CPU platform: nothing to move.

    verl's versions move megatron's DDP parameter buffer (``buffer.param_data``), which megatron-core allocates only
    with the distributed optimizer, and that one accepts CUDA tensors only (``distrib_optimizer.py``:
    ``model_param.type() == 'torch.cuda.FloatTensor'``). Without it ``param_data`` is None and verl's load fails
    (``'NoneType' object has no attribute 'storage'``). On the host, parameters already are where they are used.
    """
    for chunk in models:
        for name, param in chunk.named_parameters():
            if param.device.type != "cpu":
                raise RuntimeError(f"verl's Megatron engine on the CPU platform found {name} on {param.device}")


def local_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """verl's padding mask of the bshd path -> the causal mask megatron-core's local attention applies.

    verl's Megatron forward (``verl/models/mcore/model_forward.py``, ``preprocess_bshd_engine``) passes a
    (batch, seq) boolean mask, True on real tokens, which Transformer Engine's and flash attention's padding-causal
    kernels take. megatron-core's local ``DotProductAttention`` masks the scores (batch, heads, seq, seq) with the
    mask it is given (True = masked) and builds the causal mask only when it gets none, so it needs both in one
    (batch, 1, seq, seq) tensor: verl builds exactly that for Ascend NPUs (``verl/models/mcore/util.py``,
    ``_build_npu_attn_mask``), which is used here.
    """
    if attention_mask.dim() != 2 or attention_mask.dtype != torch.bool:
        return attention_mask  # already a full mask (or none): leave it to megatron
    from verl.models.mcore.util import _build_npu_attn_mask

    return _build_npu_attn_mask(attention_mask)  # (B, 1, S, S), True = masked


def padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The (batch, seq) real-token mask back from :func:`local_attention_mask`'s (verl's NPU branch does the same)."""
    if attention_mask.dim() != 4:
        return attention_mask
    return ~attention_mask.diagonal(dim1=-2, dim2=-1).squeeze(1)  # (B, S)


def seq_major_routes(routes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample routes (jagged (batch, len_i, layers, topk)) -> the order the routers of a padded batch see.

    megatron-core's routers see the padded batch's hidden states (seq, batch, hidden) flattened, token (s, b) at row
    s * batch + b. Returns those rows (seq * batch, layers, topk), zeros on padding, and the (seq * batch,) mask of
    real tokens (padding keeps its native route and is not counted as replayed).
    """
    lengths = routes.offsets().diff()  # (B,)
    # pad_sequence, not to_padded_tensor: a jagged tensor built from offsets may carry no (or a wrong) max length.
    padded = torch.nn.utils.rnn.pad_sequence(list(routes.unbind()), batch_first=True)  # (B, S, L, K)
    batch, seq = padded.shape[:2]
    valid = torch.arange(seq, device=lengths.device)[None, :] < lengths[:, None]  # (B, S)
    return padded.transpose(0, 1).reshape(seq * batch, *padded.shape[2:]), valid.transpose(0, 1).reshape(-1)


def per_sample_routes(seq_major: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`seq_major_routes`: rows (seq * batch, layers, topk) -> jagged (batch, len_i, layers, topk)."""
    batch, seq = len(lengths), int(lengths.max())
    if seq_major.shape[0] != seq * batch:
        raise ValueError(
            f"router replay on a padded batch: recorded {seq_major.shape[0]} routes, expected {seq} x {batch}"
        )
    padded = seq_major.reshape(seq, batch, *seq_major.shape[1:]).transpose(0, 1)  # (B, S, L, K)
    return torch.nested.as_nested_tensor([padded[i, : int(n)] for i, n in enumerate(lengths)], layout=torch.jagged)


def _replay_on_padded_batches(transformer_impl) -> None:
    """verl's R2 record/replay (and R3 replay) with the layout of a padded (bshd) forward.

    verl 0.9.1 packs the recorded and replayed routes as packed (THD) sequences
    (``verl/utils/megatron/router_replay_utils.py``: ``merge_router_topk_indices`` unpacks what the routers recorded
    with ``postprocess_thd_engine``, ``set_router_replay_data`` packs the replay data with ``preprocess_thd_engine``),
    the only layout its Megatron engine runs on a GPU; a padded batch routes seq x batch rows, padding included. Both
    functions are called here on one "sample" holding the rows in the routers' own order, and the result is turned
    into per-sample routes (record) or built from them (replay), so verl's own code does the rest.
    """
    merge_original = vars(transformer_impl)["merge_router_topk_indices"]
    replay_original = vars(transformer_impl)["set_router_replay_data"]

    @functools.wraps(merge_original)
    def merge_router_topk_indices(attention_mask, input_ids, mini_layer_topk_idx_list, *args, **kwargs):
        if not input_ids.is_nested:
            return merge_original(attention_mask, input_ids, mini_layer_topk_idx_list, *args, **kwargs)
        lengths = input_ids.offsets().diff()
        rows = len(lengths) * int(lengths.max())
        one_sample = torch.nested.as_nested_tensor([input_ids.values().new_zeros(rows)], layout=torch.jagged)
        merge_original(attention_mask, one_sample, mini_layer_topk_idx_list, *args, **kwargs)
        mini_layer_topk_idx_list[-1] = per_sample_routes(mini_layer_topk_idx_list[-1].values(), lengths)

    @functools.wraps(replay_original)
    def set_router_replay_data(layers_topk_idx, attention_mask, *args, replay_mask=None, **kwargs):
        if not layers_topk_idx.is_nested:
            return replay_original(layers_topk_idx, attention_mask, *args, replay_mask=replay_mask, **kwargs)
        rows, valid = seq_major_routes(layers_topk_idx)
        if replay_mask is not None:  # R3: the rows verl replays (all but each sample's last), same layout
            replayed, replayed_valid = seq_major_routes(replay_mask)
            if replayed.shape != valid.shape or not torch.equal(replayed_valid, valid):
                raise ValueError(
                    f"router replay on a padded batch: replay mask of {replayed.shape[0]} rows does not match the "
                    f"routes' {valid.shape[0]}"
                )
            valid = valid & replayed.bool()
        one_sample = torch.nested.as_nested_tensor([rows], layout=torch.jagged)
        mask = torch.nested.as_nested_tensor([valid], layout=torch.jagged)
        return replay_original(one_sample, attention_mask, *args, replay_mask=mask, **kwargs)

    transformer_impl.merge_router_topk_indices = merge_router_topk_indices
    transformer_impl.set_router_replay_data = set_router_replay_data


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_weights(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF checkpoint layout (one tensor per expert and projection) -> transformers 5's in-memory expert layout.

    mbridge exports Qwen3-MoE experts as a checkpoint stores them (``...mlp.experts.<e>.{gate,up,down}_proj.weight``,
    what vLLM's loader reads); transformers 5 holds them fused per layer, ``...mlp.experts.gate_up_proj``
    (experts, 2 * moe_intermediate, hidden; gate rows first) and ``...mlp.experts.down_proj`` (experts, hidden,
    moe_intermediate), which is what the hf_cpu rollout server loads. Other tensors pass through unchanged; the fused
    ones follow once the stream ends (the server takes a whole state dict).
    """
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in named_tensors:
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
        experts.setdefault(prefix, {}).setdefault(projection, {})[expert] = tensor
    for prefix, projections in experts.items():
        ids = sorted(projections.get("down_proj", {}))
        if ids != list(range(len(ids))) or any(sorted(projections.get(p, {})) != ids for p in ("gate_proj", "up_proj")):
            raise ValueError(
                f"{prefix}: the exported experts are incomplete ({ {p: sorted(v) for p, v in projections.items()} })"
            )
        gate_up = [torch.cat([projections["gate_proj"][e], projections["up_proj"][e]], dim=0) for e in ids]
        yield f"{prefix}.gate_up_proj", torch.stack(gate_up)  # (E, 2I, H)
        yield f"{prefix}.down_proj", torch.stack([projections["down_proj"][e] for e in ids])  # (E, H, I)


def _on_engine_import() -> None:
    """Register verl's Megatron engines for ``cpu``; the first engine built applies the megatron-core/mbridge patches.

    verl imports its Megatron engine module in every worker (``verl.workers.engine`` imports all engines), also on
    the FSDP CPU preset: only a process that builds a Megatron engine gets megatron-core's process-wide CPU patch.
    """
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron import transformer_impl
    from verl.workers.engine.megatron.transformer_impl import (
        MegatronEngine,
        MegatronEngineWithLMHead,
        MegatronEngineWithValueHead,
    )

    registered = EngineRegistry._engines
    for model_type, engine in (
        ("language_model", MegatronEngineWithLMHead),
        ("value_model", MegatronEngineWithValueHead),
    ):
        if "cpu" not in registered.get(model_type, {}).get("megatron", {}):
            EngineRegistry.register(model_type=model_type, backend="megatron", device="cpu")(engine)
    original = vars(MegatronEngine)["__init__"]
    if hasattr(original, _ORIGINAL_ATTR):
        return
    for name in ("load_megatron_model_to_gpu", "offload_megatron_model_to_cpu"):
        setattr(transformer_impl, name, _parameters_stay_on_the_host)
    from verl.models.mcore import model_forward

    preprocess_bshd = vars(model_forward)["preprocess_bshd_engine"]

    @functools.wraps(preprocess_bshd)
    def preprocess_bshd_engine(*args, **kwargs):
        input_ids, attention_mask, position_ids = preprocess_bshd(*args, **kwargs)
        return input_ids, local_attention_mask(attention_mask), position_ids

    postprocess_bshd = vars(model_forward)["postprocess_bshd_engine"]

    @functools.wraps(postprocess_bshd)
    def postprocess_bshd_engine(output, attention_mask, *args, **kwargs):
        return postprocess_bshd(output, padding_mask(attention_mask), *args, **kwargs)

    model_forward.preprocess_bshd_engine = preprocess_bshd_engine
    _replay_on_padded_batches(transformer_impl)
    model_forward.postprocess_bshd_engine = postprocess_bshd_engine

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        _patch_dependencies()
        original(self, *args, **kwargs)

    setattr(__init__, _ORIGINAL_ATTR, original)
    MegatronEngine.__init__ = __init__
    original_export = vars(MegatronEngine)["get_per_tensor_param"]

    @functools.wraps(original_export)
    def get_per_tensor_param(self, *args, **kwargs):
        per_tensor_param, peft_config = original_export(self, *args, **kwargs)
        return fuse_expert_weights(per_tensor_param), peft_config

    setattr(get_per_tensor_param, _ORIGINAL_ATTR, original_export)
    MegatronEngine.get_per_tensor_param = get_per_tensor_param


def apply() -> None:
    """Accept fp32 Megatron configs now; patch the engine's dependencies when verl imports it (idempotent)."""
    global _applied
    if _applied:
        return
    from respo_verl.verl.patches.verl_0_9_1_cpu_platform import _RegisterAfterImport

    _accept_fp32()
    if MEGATRON_ENGINE_MODULE in sys.modules:
        _on_engine_import()
    else:
        sys.meta_path.insert(0, _RegisterAfterImport(MEGATRON_ENGINE_MODULE, _on_engine_import))
    _applied = True
