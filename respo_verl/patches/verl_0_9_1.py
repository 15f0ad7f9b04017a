"""Patches of verl 0.9.1, each a :class:`respo_verl.patches.Patch` that refuses any other verl version.

None is applied on import. The first four serve verl on a CPU machine; the last one every run of the respo-verl
trainer.

- :data:`GLOO_DEFAULT_BACKEND`, applied by the CPU runtime (``respo_verl.cpu.runtime.enable``).
  ``verl.utils.distributed.initialize_global_process_group_ray`` defaults its backend to
  ``"cpu:gloo,<device>:<collective backend>"``; on the CPU platform that is ``"cpu:gloo,cpu:gloo"``, which torch
  rejects ("Duplicate device type cpu"). ``verl.workers.engine_workers`` calls it without a backend and imports it by
  name, so the patch rebinds the name in both modules. Only the default changes: an explicit ``backend`` passes
  through, and on any platform other than CPU verl's function runs unchanged.
  Delete when: verl builds the default backend without repeating the ``cpu`` device type.
- :data:`FP32_MEGATRON_CONFIG`, applied by the CPU runtime. ``McoreEngineConfig.__post_init__``
  (``verl/workers/config/engine.py``) accepts ``dtype`` bfloat16 or float16 only. With bf16 parameters
  megatron-core wraps Adam in ``Float16OptimizerWithFloat16Params``, which accepts parameters by their CUDA type name
  only, so a CPU run needs fp32 parameters (megatron-core's ``FP32Optimizer``); fp32 is also what makes the
  rollout's and the trainer's log-probs comparable. verl's own check still runs on every other value.
  Delete when: verl's Megatron engine config accepts fp32.
- :data:`MEGATRON_ENGINE_ON_CPU`, applied by the CPU Megatron engine when it is built
  (``respo_verl.cpu.megatron``), so a process that never builds one is left alone. In
  ``verl/workers/engine/megatron/transformer_impl.py`` and ``verl/models/mcore/model_forward.py``, module functions
  that the engine's methods call by name:

  - ``load_megatron_model_to_gpu`` / ``offload_megatron_model_to_cpu`` become a check that every parameter is on the
    host (:func:`parameters_stay_on_the_host`);
  - the padding mask of verl's bshd forward becomes the causal mask megatron-core's local attention needs
    (:func:`local_attention_mask`), and back (:func:`padding_mask`);
  - verl's R2 record / R3 replay get the route layout of a padded (bshd) batch (:func:`seq_major_routes`,
    :func:`per_sample_routes`).

  Delete when: verl's Megatron engine runs on a CPU platform with megatron-core's local layers.
- :data:`SAMPLE_REQUEST_IDS`, applied by the CPU runtime. With ``rollout.full_determinism`` verl's single-turn agent
  loop names its request ``det-<priority>``, and verl's TransferQueue agent loop (the V1 trainer's) passes no
  priority: every request of a step is ``det-0``, so the CPU rollout server, which seeds each request from its id,
  sampled the n responses of a prompt (and every prompt) from one random stream, and every group had one reward.
  Under the patch a request without a priority gets one derived from the sample (:func:`sample_priority`: the
  dataset index, the session, i.e. which of the n responses it is, and the prompt), the same in every run.
  Delete when: verl's TransferQueue agent loop gives each sample a priority of its own.
- :data:`FILE_LOGGER_APPEND`, applied by the respo-verl trainer (``respo_verl/run/respo_trainer.py``) in the process
  that builds verl's ``Tracking``. verl's ``verl.utils.tracking.FileLogger`` opens its file with ``"wb"``, so a
  resumed run erases the steps it logged before the pre-emption. Under the patch ``Tracking`` builds
  :class:`AppendingFileLogger`: same file, same lines, but a file that already holds lines is appended to, after
  one line ``{"event": "resume", "attempt": k}`` (:data:`RESUME_EVENT`) that marks where the attempt starts; readers
  keep the last attempt's line of a repeated step (``respo_verl/tools/runs/logs.py``).
  Delete when: verl's file logger appends on resume.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from typing import Any

import torch

from respo_verl.patches import Patch

VERL = "verl"
VERSION = "0.9.1"
CPU_BACKEND = "cpu:gloo"
# PrecisionType's names of float32 (verl/utils/torch_dtypes.py FLOAT_LIST, the strings).
FP32_NAMES = ("fp32", "float32", "32")
# A dtype verl's own check accepts, stood in while it runs on an fp32 config.
_CHECKED_DTYPE = "bfloat16"
MEGATRON_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
SINGLE_TURN_MODULE = "verl.experimental.agent_loop.single_turn_agent_loop"


def _gloo_default_backend(patch: Patch) -> None:
    from verl.utils import distributed
    from verl.utils.device import get_device_name

    original = vars(distributed)["initialize_global_process_group_ray"]

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None and get_device_name() == "cpu":
            backend = CPU_BACKEND
        return original(timeout_second=timeout_second, backend=backend)

    why = "the default backend repeats the cpu device type on the CPU platform"
    patch.replace(distributed, "initialize_global_process_group_ray", initialize_global_process_group_ray, why)

    def rebind_in_engine_workers() -> None:
        workers = sys.modules["verl.workers.engine_workers"]
        if vars(workers).get("initialize_global_process_group_ray") is original:
            patch.replace(workers, "initialize_global_process_group_ray", initialize_global_process_group_ray, why)

    patch.after_import("verl.workers.engine_workers", rebind_in_engine_workers, "it imports the function by name")


GLOO_DEFAULT_BACKEND = Patch(
    "cpu:gloo default process-group backend on the CPU platform", VERL, VERSION, _gloo_default_backend
)


def _fp32_megatron_config(patch: Patch) -> None:
    from verl.workers.config.engine import McoreEngineConfig

    original = vars(McoreEngineConfig)["__post_init__"]

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

    patch.replace(McoreEngineConfig, "__post_init__", __post_init__, "verl accepts bf16/fp16 only; CPU needs fp32")


FP32_MEGATRON_CONFIG = Patch("McoreEngineConfig accepts dtype fp32", VERL, VERSION, _fp32_megatron_config)


def parameters_stay_on_the_host(models, *args, **kwargs) -> None:
    """verl's ``load_megatron_model_to_gpu`` / ``offload_megatron_model_to_cpu`` on the CPU platform: nothing to move.

    verl's versions move megatron's DDP parameter buffer (``buffer.param_data``) between the GPU and the host;
    megatron-core allocates that buffer only with the distributed optimizer, and without it ``param_data`` is None and
    verl's load fails (``'NoneType' object has no attribute 'storage'``). On the host, with or without the distributed
    optimizer, parameters already are where they are used.
    """
    for chunk in models:
        for name, param in chunk.named_parameters():
            if param.device.type != "cpu":
                raise RuntimeError(f"verl's Megatron engine on the CPU platform found {name} on {param.device}")


def local_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """verl's padding mask of the bshd path -> the causal mask megatron-core's local attention applies.

    verl's Megatron forward (``preprocess_bshd_engine``) passes a (batch, seq) boolean mask, True on real tokens,
    which Transformer Engine's and flash attention's padding-causal kernels take. megatron-core's local
    ``DotProductAttention`` masks the scores (batch, heads, seq, seq) with the mask it is given (True = masked) and
    builds the causal mask only when it gets none, so it needs both in one (batch, 1, seq, seq) tensor.
    """
    if attention_mask.dim() != 2 or attention_mask.dtype != torch.bool:
        return attention_mask  # already a full mask (or none): leave it to megatron
    seq = attention_mask.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()  # (S, S)
    visible = attention_mask[:, :, None] & attention_mask[:, None, :] & causal  # (B, S, S), query x key
    return (~visible)[:, None]  # (B, 1, S, S), True = masked


def padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The (batch, seq) real-token mask back from :func:`local_attention_mask`'s (its diagonal)."""
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


def _route_layout_of_padded_batches(patch: Patch, transformer_impl) -> None:
    """verl's R2 record/replay (and R3 replay) with the layout of a padded (bshd) forward.

    verl 0.9.1 packs the recorded and replayed routes as packed (THD) sequences (``router_replay_utils.py``:
    ``merge_router_topk_indices`` unpacks what the routers recorded with ``postprocess_thd_engine``,
    ``set_router_replay_data`` packs the replay data with ``preprocess_thd_engine``), the only layout its Megatron
    engine runs on a GPU; a padded batch routes seq x batch rows, padding included. Both functions are called here on
    one "sample" holding the rows in the routers' own order, and the result is turned into per-sample routes
    (record) or built from them (replay), so verl's own code does the rest.
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

    why = "routes are laid out for packed (THD) sequences; the CPU path runs padded (bshd) batches"
    patch.replace(transformer_impl, "merge_router_topk_indices", merge_router_topk_indices, why)
    patch.replace(transformer_impl, "set_router_replay_data", set_router_replay_data, why)


def _megatron_engine_on_cpu(patch: Patch) -> None:
    from verl.models.mcore import model_forward
    from verl.workers.engine.megatron import transformer_impl

    why = "on the host there is no device to move megatron's parameter buffer to or from"
    for name in ("load_megatron_model_to_gpu", "offload_megatron_model_to_cpu"):
        patch.replace(transformer_impl, name, parameters_stay_on_the_host, why)
    preprocess_bshd = vars(model_forward)["preprocess_bshd_engine"]
    postprocess_bshd = vars(model_forward)["postprocess_bshd_engine"]

    @functools.wraps(preprocess_bshd)
    def preprocess_bshd_engine(*args, **kwargs):
        input_ids, attention_mask, position_ids = preprocess_bshd(*args, **kwargs)
        return input_ids, local_attention_mask(attention_mask), position_ids

    @functools.wraps(postprocess_bshd)
    def postprocess_bshd_engine(output, attention_mask, *args, **kwargs):
        return postprocess_bshd(output, padding_mask(attention_mask), *args, **kwargs)

    why = "megatron-core's local attention needs the causal mask with the padding in it"
    patch.replace(model_forward, "preprocess_bshd_engine", preprocess_bshd_engine, why)
    patch.replace(model_forward, "postprocess_bshd_engine", postprocess_bshd_engine, why)
    _route_layout_of_padded_batches(patch, transformer_impl)


MEGATRON_ENGINE_ON_CPU = Patch("verl's Megatron engine on padded CPU batches", VERL, VERSION, _megatron_engine_on_cpu)


def sample_priority(index: Any, session_id: Any, raw_prompt: Any) -> int:
    """A request priority (hence, with ``full_determinism``, the request id ``det-<priority>``) that names one
    sample: its dataset index, its session (which of the prompt's n responses) and its prompt; below 2**56."""
    digest = hashlib.sha256(f"{index}/{session_id}/{raw_prompt!r}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def _sample_request_ids(patch: Patch) -> None:
    def wrap_run() -> None:
        from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

        original = vars(SingleTurnAgentLoop)["run"]

        @functools.wraps(original)
        async def run(self, sampling_params, **kwargs):
            if "priority" not in kwargs and "session_id" in kwargs:
                sample = (kwargs.get("index"), kwargs["session_id"], kwargs.get("raw_prompt"))
                kwargs["priority"] = sample_priority(*sample)
            return await original(self, sampling_params, **kwargs)

        why = "the TransferQueue agent loop passes no priority: with full_determinism every request is det-0"
        patch.replace(SingleTurnAgentLoop, "run", run, why)

    patch.after_import(SINGLE_TURN_MODULE, wrap_run, "a request id of its own for every sample")


SAMPLE_REQUEST_IDS = Patch("a request id of its own for every sample", VERL, VERSION, _sample_request_ids)


# The line an appending file logger writes where a resumed attempt starts.
RESUME_EVENT = "resume"


def _appending_file_logger(file_logger_cls: type) -> type:
    """verl's FileLogger, appending (see the module docstring)."""
    import orjson

    class AppendingFileLogger(file_logger_cls):
        def __init__(self, project_name: str, experiment_name: str):
            import os

            self.project_name, self.experiment_name = project_name, experiment_name
            self.filepath = os.getenv("VERL_FILE_LOGGER_PATH", None)
            if self.filepath is None:
                root = os.path.expanduser(os.getenv("VERL_FILE_LOGGER_ROOT", "."))
                os.makedirs(os.path.join(root, project_name), exist_ok=True)
                self.filepath = os.path.join(root, project_name, f"{experiment_name}.jsonl")
            os.makedirs(os.path.dirname(os.path.abspath(self.filepath)), exist_ok=True)  # a fresh sweep's logs/
            attempts, cut = 0, False
            if os.path.isfile(self.filepath) and os.path.getsize(self.filepath) > 0:
                with open(self.filepath, "rb") as fh:
                    attempts = 2 + sum(b'"event":"resume"' in line for line in fh)
                    fh.seek(-1, os.SEEK_END)
                    cut = fh.read(1) != b"\n"  # the attempt before was killed while writing a line
            print(f"Creating file logger at {os.path.abspath(self.filepath)} ({'appending' if attempts else 'new'})")
            self.fp = open(self.filepath, "ab", buffering=0)
            if attempts:
                # The resume line starts a line of its own; a cut line stays as it was, for the reader to report.
                event = orjson.dumps({"event": RESUME_EVENT, "attempt": attempts})
                self.fp.write((b"\n" if cut else b"") + event + b"\n")

    return AppendingFileLogger


def _file_logger_append(patch: Patch) -> None:
    from verl.utils import tracking

    why = "verl's file logger truncates its file, so a resumed run loses the steps it logged before"
    patch.replace(tracking, "FileLogger", _appending_file_logger(vars(tracking)["FileLogger"]), why)


FILE_LOGGER_APPEND = Patch("verl's file logger appends on resume", VERL, VERSION, _file_logger_append)
