"""Run megatron-core 0.16.1 models on CPU: neutralise the CUDA-only calls a CPU forward/backward reaches.

Written against: megatron-core 0.16.1 (torch 2.13 CPU build, Transformer Engine absent).

Why: megatron-core hard-codes CUDA in a few places that a CPU forward and backward of a GPTModel with MoE reach,
although the computation itself runs on any device. :data:`CPU` (``CPU.apply()``, ``CPU.remove()``) replaces
exactly those:

- ``torch.cuda.current_device`` → ``"cpu"`` (buffers are allocated on it; the router's ``gating()`` moves its
  weight there);
- ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``stream`` → objects whose methods do nothing (the MoE
  token dispatchers record and wait on them); ``torch.cuda.synchronize`` → nothing (dist-checkpointing's save
  synchronises before it copies the tensors to the host, which on CPU they are already);
- the model-parallel CUDA RNG tracker's ``fork`` → a null context, its ``get_states`` → the CPU generator's state
  (a checkpoint must hold a non-empty one), ``set_states`` → nothing; CUDA
  RNG state get/set (activation recompute) → the CPU generator's state, so a recompute replays the same stream;
- ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` → ``None`` when Transformer Engine is absent (0.16.1
  reads the name without a guard);
- the modules listed in ``_CUDA_LITERAL_MODULES`` (pipeline schedules, MoE utilities, the optimizer, ...) create
  token counters, metric trackers and the optimizer's loss-scale, found-inf and grad-norm scalars with
  ``device='cuda'`` written out: their module-level name ``torch`` becomes :class:`TorchOnDevice`, a view of torch
  whose tensor factories (``tensor``, ``zeros``, ``ones``, ``empty``, ``full`` and the ``_like`` ones) put
  ``device='cuda'`` tensors on the CPU (everything else is torch itself);
- ``maybe_move_tensor_to_cpu`` as the MoE token dispatchers use it: on a GPU it brings the all-to-all split sizes to
  the host as numpy arrays, which ``torch.distributed.all_to_all_single`` takes as its size lists; tensors already on
  the CPU were returned unchanged, and ``all_to_all_single`` rejects a tensor there (expert parallelism > 1). The CPU
  version returns them as numpy arrays too;
- ``clip_grad_by_total_norm_fp32`` as the optimizer module uses it: megatron-core's asserts
  ``param.grad.type() == 'torch.cuda.FloatTensor'`` before it scales the gradients; the CPU version checks for fp32
  gradients instead and scales them by the same ``max_norm / (total_norm + 1e-6)`` when that is below 1 (the norm
  itself is still megatron's ``get_grad_norm_fp32``);
- the exchange of a fully parallel dist-checkpoint load (verl's ``load_dist_checkpointing`` spreads the reads over
  the data-parallel ranks, then each shard goes to every rank that needs it): megatron-core's default, a broadcast
  per shard, first moves each shard to CUDA (``.cuda()``, expert parallelism > 1 on CPU). Its own
  ``exchange_loaded_tensors_gather_object``, one ``all_gather_object`` of the host tensors, takes the broadcast's
  place: every rank gets the same bytes.

It is a stand-in for the device, not for megatron: every megatron code path runs as written. It is process-global
(it patches ``torch.cuda``), so apply it only in a process that never uses a GPU: the CPU Megatron engine
(``respo_verl.cpu.megatron``) does, when it is built. Nothing happens on import. Starting a process group and
megatron's model-parallel state stays with the caller.

Delete when: megatron-core runs on CPU without it (device-agnostic current device, streams and RNG tracker), or
when no CPU test or benchmark drives megatron-core any more.

:data:`DISTRIBUTED_OPTIMIZER`, applied with it by the CPU Megatron engine, runs megatron-core's distributed optimizer
(``use_distributed_optimizer``, the cluster presets' setting) on host parameters with torch's Adam, the one Adam
megatron-core takes where Transformer Engine and Apex are absent. Three methods of ``DistributedOptimizer``, each the
original with a step before or after it:

- ``_build_model_and_main_param_groups`` sorts the parameters by ``.type()`` and refuses any name but
  ``torch.cuda.{Float,Half,BFloat16}Tensor``: it runs while a host tensor's ``.type()`` names its CUDA type (a
  ``Patch`` of ``Tensor.type`` for the call only; the dtype is still what is checked);
- ``state_dict`` reads torch's Adam's step count from per-parameter state that torch creates at the first step, so a
  fresh optimizer (each resume builds its sharded state dict on one) failed ``assert len(steps) == 1``: it is first
  given what that step would create (step 0, zero moments);
- ``load_state_dict`` runs under ``torch.no_grad()`` (the ``dp_reshardable`` load copies into fp32 main parameters,
  which are views of the model's parameters) and then gives each parameter's state the checkpoint's step count in a
  tensor of its own (megatron-core shares one tensor among them and the ``dp_reshardable`` load overwrites it with
  the fresh optimizer's step: a resume restarted Adam's bias correction at step 0, and torch's single-tensor Adam
  added 1 to the shared tensor once per parameter).

Delete when: megatron-core's distributed optimizer accepts host tensors and saves and loads torch's Adam's step
count per parameter, or when the CPU presets leave the distributed optimizer off.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

from respo_verl.patches import Patch


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


# megatron-core modules that write device='cuda' into tensor factories on the path of a training step (pipeline
# schedules' token counters, MoE metric trackers, broadcast sizes, the optimizer's scalars).
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
)


class TorchOnDevice:
    """``torch`` as a module-level name of a megatron-core module, with ``device='cuda'`` in its tensor factories
    meaning ``device`` instead: the CPU here, the meta device in the meta build (:mod:`respo_verl.patches.meta_build`).
    Every other name, and a factory called with any other device, is torch's own."""

    FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like")

    def __init__(self, torch_module, device: str):
        self._torch = torch_module
        for name in self.FACTORIES:
            setattr(self, name, self._on(device, getattr(torch_module, name)))

    @staticmethod
    def _on(device: str, factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = device
            return factory(*args, **kwargs)

        return make

    def __getattr__(self, name):
        return getattr(self._torch, name)


# megatron-core's clip_grads.py: the epsilon added to the total norm before the clip coefficient is formed.
_CLIP_EPS = 1.0e-6


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's ``clip_grad_by_total_norm_fp32`` for CPU tensors (see the module docstring)."""
    import torch

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    name = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, name).detach() for p in parameters if getattr(p, name, None) is not None]
    wrong = sorted({str(g.dtype) for g in grads if g.dtype not in (torch.float32, torch.bfloat16)})
    if wrong or (not use_decoupled_grad and any(g.dtype != torch.float32 for g in grads)):
        raise TypeError(f"gradient clipping expects fp32 gradients, got {wrong or 'bf16'}")
    clip_coeff = max_norm / (total_norm + _CLIP_EPS)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _host_copy(original):
    """megatron-core's ``maybe_move_tensor_to_cpu``, which also hands CPU tensors back as numpy when asked to."""

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        import torch

        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _install(patch: Patch) -> None:
    import torch
    from megatron.core.dist_checkpointing import exchange_utils
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    tracker = megatron_random.get_cuda_rng_tracker()
    no_cuda = "megatron-core calls it on every device; on CPU it must not reach CUDA"
    patch.replace(torch.cuda, "current_device", lambda: "cpu", no_cuda)
    patch.replace(torch.cuda, "Stream", _NoOpStream, no_cuda)
    patch.replace(torch.cuda, "Event", _NoOpEvent, no_cuda)
    patch.replace(torch.cuda, "current_stream", lambda *a, **k: _NoOpStream(), no_cuda)
    patch.replace(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext(), no_cuda)
    patch.replace(torch.cuda, "synchronize", lambda *a, **k: None, "dist-checkpointing's save synchronises first")
    patch.replace(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state(), "recompute saves RNG state")
    patch.replace(megatron_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state(), no_cuda)
    patch.replace(megatron_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state), no_cuda)
    patch.replace(tracker, "fork", lambda *a, **k: contextlib.nullcontext(), "the CUDA RNG tracker forks CUDA state")
    # Not empty: verl's Megatron checkpoint load refuses an empty tracker state. On CPU the tracker forks nothing,
    # so its state is the CPU generator's (which verl saves and restores on its own as well).
    patch.replace(tracker, "get_states", lambda: {"cpu": torch.get_rng_state()}, "no CUDA RNG state on CPU")
    patch.replace(tracker, "set_states", lambda states: None, "the CUDA RNG tracker has no CPU state")
    if not hasattr(moe_utils, "te_general_gemm"):
        patch.replace(moe_utils, "te_general_gemm", None, "0.16.1 reads the name without a guard")
    patch.replace(
        megatron_optimizer,
        "clip_grad_by_total_norm_fp32",
        _clip_grad_by_total_norm_fp32,
        "megatron-core asserts CUDA gradient types before it scales them",
    )
    patch.replace(
        token_dispatcher,
        "maybe_move_tensor_to_cpu",
        _host_copy(token_dispatcher.maybe_move_tensor_to_cpu),
        "all-to-all split sizes must reach torch as host lists",
    )
    patch.replace(
        exchange_utils,
        "exchange_loaded_tensors_broadcast",
        exchange_utils.exchange_loaded_tensors_gather_object,
        "the fully parallel load's broadcast moves every shard to CUDA first",
    )
    cpu_torch = TorchOnDevice(torch, "cpu")
    for module_name in _CUDA_LITERAL_MODULES:
        patch.replace(importlib.import_module(module_name), "torch", cpu_torch, "device='cuda' written out")


CPU = Patch("megatron-core on CPU: CUDA-only calls of a forward/backward", "megatron-core", "0.16.1", _install)


def type_named_as_cuda(original_type, device: str, prefix: str):
    """``Tensor.type()`` naming a ``device`` tensor's CUDA type, its type name's ``prefix`` becoming ``torch.cuda.``
    (host: ``torch.FloatTensor`` → ``torch.cuda.FloatTensor``; meta: ``torch.meta.BFloat16Tensor`` →
    ``torch.cuda.BFloat16Tensor``); any other tensor, or a call that converts, is left to ``original_type``."""

    @functools.wraps(original_type)
    def type_(self, *args, **kwargs):
        name = original_type(self, *args, **kwargs)
        if args or kwargs or self.device.type != device:
            return name
        return name.replace(prefix, "torch.cuda.", 1)

    return type_


def _install_host_types_as_cuda(patch: Patch) -> None:
    import torch

    patch.replace(
        torch.Tensor,
        "type",
        type_named_as_cuda(torch.Tensor.type, "cpu", "torch."),
        "the shards' dtype check names CUDA types",
    )


def _shards_of_host_parameters(original):
    """``DistributedOptimizer._build_model_and_main_param_groups`` run while a host tensor's ``.type()`` names its
    CUDA type: megatron-core sorts the parameters into fp32 and fp16/bf16 shards by ``.type()`` and refuses any
    name outside ``torch.cuda.{Float,Half,BFloat16}Tensor``. Only for the call: a Patch of its own, removed after."""

    @functools.wraps(original)
    def build(cls, *args, **kwargs):
        names = Patch("host tensors named by their CUDA type", "megatron-core", "0.16.1", _install_host_types_as_cuda)
        names.apply()
        try:
            return original(cls, *args, **kwargs)
        finally:
            names.remove()

    return classmethod(build)


def _torch_adam(distributed_optimizer) -> bool:
    """True where megatron-core steps with torch's Adam (Transformer Engine and Apex absent: its step-count branch)."""
    import torch
    from megatron.core.optimizer import distrib_optimizer

    inner = distributed_optimizer.optimizer
    return not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def _state_dict_of_a_fresh_adam(original):
    """``DistributedOptimizer.state_dict`` that also answers before the first step: with torch's Adam megatron-core
    reads the step count from the per-parameter state, which torch's Adam creates only at its first step
    (``assert len(steps) == 1`` on an optimizer that has not stepped: every resume, as the load builds its sharded
    state dict first). The state is first given what that first step would create (step 0, zero moments)."""

    @functools.wraps(original)
    def state_dict(self):
        if _torch_adam(self) and not self.optimizer.state:
            import torch

            for group in self.optimizer.param_groups:
                for main_param in group["params"]:
                    state = self.optimizer.state[main_param]
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
                        state[key] = torch.zeros_like(main_param, memory_format=torch.preserve_format)
        return original(self)

    return state_dict


def _load_state_dict_of_fp32_shards(original):
    """``DistributedOptimizer.load_state_dict`` for fp32 parameters and torch's Adam:

    - under ``torch.no_grad()``: with fp32 parameters the optimizer's main parameters are views of the model's
      (no fp32 copy is made), and the ``dp_reshardable`` load copies into them in place, which autograd refuses for a
      view of a leaf that requires grad (``load_parameter_state_from_dp_reshardable`` has no ``no_grad``, the
      ``fully_sharded_model_space`` load has);
    - then each parameter's Adam state gets the checkpoint's step count, a tensor of its own. With torch's Adam
      megatron-core saves the step once, in the param groups, and loads it into one tensor that every parameter's
      state shares; the ``dp_reshardable`` load then copies into it the step of the state being loaded into (a
      fresh optimizer's 0: the step is not saved per parameter, the state it was built from stands in for it), and
      torch's single-tensor Adam (the CPU's) adds 1 to a shared tensor once per parameter. Adam's bias correction
      after a resume would use neither the right step nor the same one for every parameter.
    """

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        import torch

        with torch.no_grad():
            original(self, state_dict)
        groups = state_dict.get("optimizer", {}).get("param_groups", []) if isinstance(state_dict, dict) else []
        steps = {group["step"] for group in groups if "step" in group}
        if _torch_adam(self) and len(steps) == 1:
            (step,) = steps
            for state in self.optimizer.state.values():
                state["step"] = torch.tensor(float(step), dtype=torch.float32)

    return load_state_dict


def _install_distributed_optimizer(patch: Patch) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = vars(DistributedOptimizer)["_build_model_and_main_param_groups"].__func__
    patch.replace(
        DistributedOptimizer,
        "_build_model_and_main_param_groups",
        _shards_of_host_parameters(original),
        "it accepts parameters whose .type() names torch.cuda.* only",
    )
    patch.replace(
        DistributedOptimizer,
        "state_dict",
        _state_dict_of_a_fresh_adam(vars(DistributedOptimizer)["state_dict"]),
        "with torch's Adam it reads the step from state that exists only after a first step",
    )
    patch.replace(
        DistributedOptimizer,
        "load_state_dict",
        _load_state_dict_of_fp32_shards(vars(DistributedOptimizer)["load_state_dict"]),
        "in-place copies into fp32 views of parameters; one step tensor shared by every parameter",
    )


DISTRIBUTED_OPTIMIZER = Patch(
    "megatron-core on CPU: the distributed optimizer with host parameters and torch's Adam",
    "megatron-core",
    "0.16.1",
    _install_distributed_optimizer,
)
