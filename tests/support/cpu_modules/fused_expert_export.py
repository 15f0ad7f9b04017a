"""Fault for the weight-sync checks: the CPU Megatron engine hands the rollout transformers 5's fused expert tensors
(``mlp.experts.gate_up_proj``), as it did before the trainer sent the checkpoint's per-expert layout. vLLM's
Qwen3-MoE loader skips those names without a word, so from step 2 vLLM samples with the experts it started with.

Loaded in every Ray process of one test run through ``VERL_USE_EXTERNAL_MODULES`` (after the CPU runtime's switch);
only the actor worker's engine calls the method.
"""

from respo_verl.cpu import megatron
from respo_verl.cpu.rollout import fuse_expert_weights


def get_per_tensor_param(self, *args, **kwargs):
    per_tensor_param, peft_config = super(megatron.CPUMegatronEngine, self).get_per_tensor_param(*args, **kwargs)
    return fuse_expert_weights(per_tensor_param), peft_config


megatron.CPUMegatronEngine.get_per_tensor_param = get_per_tensor_param
