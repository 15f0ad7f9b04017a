"""verl on CPU: importing this module switches the process to the CPU platform, gloo and the ``hf_cpu`` rollout.

It is imported only when the ``device=cpu`` preset is selected: the preset names it in
``VERL_USE_EXTERNAL_MODULES`` of Ray's runtime env (verl imports it on ``import verl`` in the TaskRunner and every
worker), ``python -m respo_verl.main_ppo`` imports it in the driver, and ``respo_verl.verl.plugin`` imports it when
``VERL_PLATFORM=cpu`` is set (the driver of ``python -m verl.trainer.main_ppo``). Importing ``respo_verl`` or the
plugin otherwise never applies it. The three patches it applies are version-keyed modules in
``respo_verl/verl/patches/`` (see ``patches/README.md``).
"""

from __future__ import annotations

from respo_verl.verl.patches import (
    verl_0_9_1_cpu_platform,
    verl_0_9_1_cpu_rollout,
    verl_0_9_1_gloo_process_group,
    verl_0_9_1_megatron_cpu,
)


def enable() -> None:
    """Apply the CPU platform, the gloo default backend, the hf_cpu rollout and verl's Megatron engine on CPU in this
    process (idempotent)."""
    verl_0_9_1_cpu_platform.apply()
    verl_0_9_1_gloo_process_group.apply()
    verl_0_9_1_cpu_rollout.apply()
    verl_0_9_1_megatron_cpu.apply()


enable()
