"""Build mbridge 0.15.1 models from megatron-core's local layers (no Transformer Engine), with the same HF weights.

Written against: mbridge 0.15.1 with megatron-core 0.16.1 (Transformer Engine absent, CPU).

Why: mbridge (verl's ``vanilla_mbridge`` path for HF <-> Megatron weights) always asks megatron-core for its
Transformer Engine layer spec (``mbridge/core/llm_bridge.py``, ``LLMBridge._get_transformer_layer_spec`` calls
``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``), and its weight-name tables only know the
parameter names of TE layers. Without Transformer Engine (any CPU machine) the model cannot be built. megatron-core's
local spec builds the same computation from plain torch modules; only two parameter names differ:

- the attention input norm is a module of its own, ``input_layernorm.weight`` (TE fuses it into the QKV projection:
  ``self_attention.linear_qkv.layer_norm_weight``);
- experts are a ``SequentialMLP`` (``mlp.experts.local_experts.<i>.linear_fc1.weight``) instead of a grouped
  GEMM (``mlp.experts.linear_fc1.weight<i>``), which needs ``moe_grouped_gemm=False`` in the model config.

:data:`LOCAL_LAYERS` makes ``get_gpt_decoder_block_spec`` (as mbridge's ``llm_bridge`` module sees it) build the local
spec, and makes ``Bridge._weight_name_mapping_mcore_local_to_global`` (used by mbridge's ``load_weights`` and
``export_weights``) translate the local names into the TE names of its tables, including the expert-parallel
renumbering of experts. Everything else (QKV and gate/up merging, TP/EP scatter and gather) is mbridge's own code.
While mbridge's ``get_model`` builds the model, ``torch.nn.Module.cuda`` to the device ``"cpu"`` leaves the module
where it is (mbridge moves every chunk with ``.cuda(torch.cuda.current_device())``, which megatron-core's CPU patch
makes ``"cpu"``), and is put back when ``get_model`` returns. It is process-global; the CPU Megatron engine
(``respo_verl.cpu.megatron``) applies it when it is built, in processes without Transformer Engine.

Delete when: mbridge builds models from the local spec itself (a ``use_transformer_engine`` switch), or when verl's
Megatron engine is no longer run on CPU.
"""

from __future__ import annotations

import functools
import re

from respo_verl.patches import Patch

_LOCAL_INPUT_NORM = re.compile(r"^(.*\.layers\.\d+)\.input_layernorm\.weight$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def te_name(name: str) -> str:
    """The Transformer Engine parameter name mbridge's tables know for a local-spec parameter ``name``.

    Expert ids stay local (mbridge's own expert-parallel renumbering applies after this).
    """
    match = _LOCAL_INPUT_NORM.match(name)
    if match:
        return f"{match.group(1)}.self_attention.linear_qkv.layer_norm_weight"
    match = _LOCAL_EXPERT.match(name)
    if match:
        return f"{match.group(1)}.{match.group(3)}.weight{match.group(2)}"
    return name


def _stay_on_cpu(module, device=None):
    if str(device) != "cpu":
        raise RuntimeError(f"mbridge's CPU patch is applied, but a model chunk was asked to move to {device!r}")
    return module


def _install(patch: Patch) -> None:
    from mbridge.core import bridge as bridge_module
    from mbridge.core import llm_bridge

    original_spec = vars(llm_bridge)["get_gpt_decoder_block_spec"]

    @functools.wraps(original_spec)
    def get_gpt_decoder_block_spec(config, use_transformer_engine, *args, **kwargs):
        if getattr(config, "moe_grouped_gemm", False):
            raise ValueError(
                "megatron-core's local layers need moe_grouped_gemm=False (grouped GEMMs need Transformer Engine); "
                "set it in actor_rollout_ref.{actor,ref}.megatron.override_transformer_config"
            )
        return original_spec(config, False, *args, **kwargs)

    original_get_model = vars(bridge_module)["get_model"]

    @functools.wraps(original_get_model)
    def get_model(*args, **kwargs):
        # mbridge moves every new model chunk with ``module.cuda(torch.cuda.current_device())``; on CPU the
        # parameters are already where they belong (megatron-core's CPU patch makes the current device "cpu").
        import torch

        module_cuda = vars(torch.nn.Module)["cuda"]
        torch.nn.Module.cuda = _stay_on_cpu
        try:
            return original_get_model(*args, **kwargs)
        finally:
            torch.nn.Module.cuda = module_cuda

    original_map = vars(bridge_module.Bridge)["_weight_name_mapping_mcore_local_to_global"]

    @functools.wraps(original_map)
    def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True):
        mapping = {local: te_name(name) for local, name in original_map(self, model, consider_ep=False).items()}
        if consider_ep and self.mpu.ep_size > 1:
            # mbridge's own renumbering of local expert ids (expert e of rank r is global e + r * experts per rank).
            per_rank = self.config.num_moe_experts // self.mpu.ep_size
            for local, name in mapping.items():
                if ".mlp.experts.linear_fc" in name:
                    prefix, expert = name.split(".weight")
                    mapping[local] = f"{prefix}.weight{int(expert) + per_rank * self.mpu.ep_rank}"
        return mapping

    patch.replace(
        llm_bridge, "get_gpt_decoder_block_spec", get_gpt_decoder_block_spec, "mbridge asks for the TE spec only"
    )
    patch.replace(bridge_module, "get_model", get_model, "model chunks stay on the host")
    patch.replace(
        bridge_module.Bridge,
        "_weight_name_mapping_mcore_local_to_global",
        _weight_name_mapping_mcore_local_to_global,
        "mbridge's name tables know TE parameter names only",
    )


LOCAL_LAYERS = Patch("mbridge on megatron-core's local layers", "mbridge", "0.15.1", _install)
