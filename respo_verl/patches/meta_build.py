"""Stand-ins for building Qwen3-30B-A3B on the meta device under a fake world (``respo-verl plan PRESET --build``).

Written against: megatron-core 0.16.1 and mbridge 0.15.1 (torch 2.13 CPU build; Transformer Engine, DeepEP, Apex
and CUDA absent).

Why: the build runs verl 0.9.1's own Megatron engine code (``initialize_model_parallel`` with the engine's
arguments, mbridge's ``AutoBridge.from_config`` and ``set_extra_args``, ``make_megatron_module``, verl's DDP
settings, ``init_megatron_optim_config``, ``get_megatron_optimizer``) on a CPU machine, one process per rank, under
torch's ``fake`` process-group backend. Without the stand-ins below every failure is a package that is not
installed, never the layout. Each stand-in replaces only an "is it installed" check, a device placement or a
module class with the same parameter shapes; what each may hide is listed in :data:`DEVIATIONS` (printed in the
header line of the build's output, and in docs/cluster.md, "Built by megatron-core, on CPU").

:data:`MEGATRON` (megatron-core 0.16.1) and :data:`MBRIDGE` (mbridge 0.15.1) are applied by the build worker
(``respo_verl.tools.plan.build``) for the build only, and removed after it. They are process-global; the build runs
each rank in a process of its own.

Delete when: Transformer Engine, DeepEP and CUDA are installed where the build runs (then nothing here is needed),
or megatron-core and mbridge build on the meta device without CUDA.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib

from respo_verl.patches import Patch
from respo_verl.patches.megatron_core_0_16_1 import TorchOnDevice, type_named_as_cuda

# (short name, what it stands in for and why, what it may hide), in the order of the header line.
DEVIATIONS: tuple[tuple[str, str, str], ...] = (
    (
        "local-spec",
        "megatron-core's local (non-TE) layer spec, experts as SequentialMLP (TE and its grouped GEMM are absent)",
        "TE module classes and fused kernels; the per-expert weights have the grouped GEMM's shapes and count",
    ),
    (
        "torch-norm",
        "RMSNorm as torch.nn.RMSNorm built with sequence_parallel/persist_layer_norm off (TE's norm takes them)",
        "nothing in the parameter counts; the weights are marked sequence-parallel as TE marks them",
    ),
    (
        "fused-permute",
        "TE's fused permute/unpermute functions present (megatron checks for them when moe_permute_fusion is set)",
        "whether TE >= 2.1 is installed on the cluster; the functions are never called in a build",
    ),
    (
        "deepep",
        "DeepEP's fused dispatch/combine present (megatron's flex dispatcher checks for them at build)",
        "whether DeepEP is installed on the cluster, and its NVSHMEM buffers",
    ),
    (
        "meta-device",
        "torch.cuda.current_device() and the optimizer's device='cuda' tensors are meta; mbridge inits on meta",
        "the CUDA context and real allocation; sizes are counted from the tensors' shapes and dtypes",
    ),
    (
        "cuda-streams",
        "torch.cuda.Stream/current_stream are inert objects (megatron's CPU optimizer holds two from its build)",
        "nothing in a build (streams are used only when stepping)",
    ),
    (
        "fake-gloo",
        "megatron's gloo groups are created with the fake backend (gloo cannot start on a fake store)",
        "NCCL and gloo communicators and their buffers",
    ),
    (
        "rng-tracker",
        "megatron's CUDA RNG tracker forks nothing (verl seeds it only where a GPU is present)",
        "nothing: meta tensors draw no random numbers",
    ),
    (
        "cuda-types",
        "a meta tensor's .type() names its CUDA type (the distributed optimizer accepts torch.cuda.* only)",
        "nothing else: the dtype is still checked",
    ),
    (
        "te-version",
        "megatron's is_te_min_version answers False where TE is absent instead of failing",
        "the TE-version branches of the precision-aware optimizer (taken as on a TE older than asked)",
    ),
)


def header_line() -> str:
    """One line naming every stand-in (the build's output starts with it)."""
    return "stand-ins (not a GPU build): " + "; ".join(f"{name}: {why}" for name, why, _ in DEVIATIONS)


class _NoStream:
    """A CUDA stream that is only held (megatron's CPU optimizer keeps two at build and uses them at its step)."""

    def __init__(self, *args, **kwargs):
        pass


def _not_installed(what: str):
    def stand_in(*args, **kwargs):
        raise RuntimeError(f"{what} is a stand-in of the meta build (respo_verl.patches.meta_build) and cannot run")

    stand_in.__name__ = f"stand_in_{what.replace(' ', '_')}"
    return stand_in


def _meta_norm(torch_norm: type) -> type:
    """megatron's ``WrappedTorchNorm`` built from a copy of the config with the two TE-only switches off."""

    class MetaBuildNorm:
        def __new__(cls, config, hidden_size, *args, **kwargs):
            plain = copy.copy(config)
            plain.sequence_parallel = False
            plain.persist_layer_norm = False
            norm = torch_norm(plain, hidden_size, *args, **kwargs)
            for param in norm.parameters():
                # TE's norm marks its weights so that megatron all-reduces their gradients over TP.
                param.sequence_parallel = config.sequence_parallel
            return norm

    return MetaBuildNorm


# megatron-core modules on the optimizer's build path that write device='cuda' into tensor factories.
_CUDA_LITERAL_MODULES = ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer")


def _te_min_version(original):
    """megatron's ``is_te_min_version``: False when Transformer Engine is not installed (it raises then)."""

    @functools.wraps(original)
    def is_te_min_version(*args, **kwargs):
        from megatron.core.utils import get_te_version

        return False if get_te_version() is None else original(*args, **kwargs)

    return is_te_min_version


def _install_megatron(patch: Patch) -> None:
    import torch
    from megatron.core import parallel_state
    from megatron.core import utils as megatron_utils
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original_create_group = vars(parallel_state)["create_group"]

    @functools.wraps(original_create_group)
    def create_group(*args, backend=None, **kwargs):
        return original_create_group(*args, backend="fake" if backend == "gloo" else backend, **kwargs)

    patch.replace(parallel_state, "create_group", create_group, "gloo cannot start on a fake store")
    patch.replace(torch.cuda, "current_device", lambda: "meta", "buffers are placed on the current device")
    patch.replace(torch.cuda, "current_stream", lambda *a, **k: _NoStream(), "the CPU optimizer keeps two streams")
    patch.replace(torch.cuda, "Stream", _NoStream, "the CPU optimizer keeps two streams")
    tracker = megatron_random.get_cuda_rng_tracker()
    patch.replace(tracker, "fork", lambda *a, **k: contextlib.nullcontext(), "the tracker forks CUDA RNG state")
    norm = _meta_norm(torch_norm.WrappedTorchNorm)
    no_te_norm = "no TE norm; torch's refuses sequence parallel"
    patch.replace(gpt_layer_specs, "LNImpl", norm, no_te_norm)
    patch.replace(backends, "LNImpl", norm, no_te_norm)
    patch.replace(backends, "WrappedTorchNorm", norm, no_te_norm)
    for name in (
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_unpermute",
    ):
        patch.replace(moe_utils, name, _not_installed(name), "TransformerConfig checks that TE's is installed")
    for name in ("fused_dispatch", "fused_combine"):
        patch.replace(token_dispatcher, name, _not_installed(name), "the flex dispatcher checks that DeepEP is")
    patch.replace(
        torch.Tensor,
        "type",
        type_named_as_cuda(torch.Tensor.type, "meta", "torch.meta."),
        "the optimizer accepts torch.cuda.* types only",
    )
    for module_name in ("megatron.core.optimizer.optimizer_config", "megatron.core.optimizer"):
        patch.replace(
            importlib.import_module(module_name),
            "is_te_min_version",
            _te_min_version(megatron_utils.is_te_min_version),
            "fails with TE absent",
        )
    meta_torch = TorchOnDevice(torch, "meta")
    for module_name in _CUDA_LITERAL_MODULES:
        patch.replace(importlib.import_module(module_name), "torch", meta_torch, "device='cuda' written out")
    patch.replace(token_dispatcher, "set_deepep_num_sms", lambda num_sms: None, "DeepEP's SM count, set at build")


def _install_mbridge(patch: Patch) -> None:
    from mbridge.core import bridge as bridge_module
    from mbridge.core import llm_bridge

    original_spec = vars(llm_bridge)["get_gpt_decoder_block_spec"]

    @functools.wraps(original_spec)
    def get_gpt_decoder_block_spec(config, use_transformer_engine, *args, **kwargs):
        # The local spec's grouped GEMM is megatron's legacy GroupedMLP, which needs the grouped_gemm package;
        # SequentialMLP holds the same per-expert weights.
        local = copy.copy(config)
        local.moe_grouped_gemm = False
        return original_spec(local, False, *args, **kwargs)

    original_get_model = vars(bridge_module)["get_model"]

    @functools.wraps(original_get_model)
    def get_model(*args, **kwargs):
        kwargs["init_model_with_meta_device"] = True
        return original_get_model(*args, **kwargs)

    patch.replace(llm_bridge, "get_gpt_decoder_block_spec", get_gpt_decoder_block_spec, "no TE: the local spec")
    patch.replace(bridge_module, "get_model", get_model, "no weights: build on the meta device")


MEGATRON = Patch("meta build: megatron-core without TE, DeepEP or CUDA", "megatron-core", "0.16.1", _install_megatron)
MBRIDGE = Patch("meta build: mbridge on the local spec, meta device", "mbridge", "0.15.1", _install_mbridge)
