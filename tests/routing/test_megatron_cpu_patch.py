"""The CPU patch of megatron-core 0.16.1: applied only when asked, idempotent, undone by remove()."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer.moe import moe_utils

from respo_verl.megatron.patches import megatron_core_0_16_1_cpu as cpu_patch


def test_apply_is_idempotent_and_remove_restores_every_original():
    originals = (torch.cuda.current_device, torch.cuda.Stream, megatron_random._set_cuda_rng_state)
    had_gemm = hasattr(moe_utils, "te_general_gemm")
    cpu_patch.apply()
    try:
        patched = torch.cuda.current_device
        cpu_patch.apply()
        assert torch.cuda.current_device is patched and torch.cuda.current_device() == "cpu"
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().wait_event(torch.cuda.Event())
        assert hasattr(moe_utils, "te_general_gemm")
        with megatron_random.get_cuda_rng_tracker().fork():
            pass
    finally:
        cpu_patch.remove()
    assert not cpu_patch.is_applied()
    assert (torch.cuda.current_device, torch.cuda.Stream, megatron_random._set_cuda_rng_state) == originals
    assert hasattr(moe_utils, "te_general_gemm") == had_gemm
    cpu_patch.remove()  # a second remove does nothing


def test_importing_the_patch_changes_nothing():
    code = (
        "import torch; before = torch.cuda.current_device\n"
        "import respo_verl.megatron.patches.megatron_core_0_16_1_cpu as p\n"
        "print(torch.cuda.current_device is before, p.is_applied())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]
