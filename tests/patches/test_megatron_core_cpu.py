"""The CPU patch of megatron-core 0.16.1: applied only when asked, idempotent, undone by ``remove()``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer.moe import moe_utils

from respo_verl.patches.megatron_core_0_16_1 import CPU as cpu_patch


def test_apply_is_idempotent_and_remove_restores_every_original():
    originals = (torch.cuda.current_device, torch.cuda.Stream, megatron_random._set_cuda_rng_state)
    had_gemm = hasattr(moe_utils, "te_general_gemm")
    assert cpu_patch.apply() is True
    try:
        patched = torch.cuda.current_device
        assert cpu_patch.apply() is False
        assert torch.cuda.current_device is patched and torch.cuda.current_device() == "cpu"
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().wait_event(torch.cuda.Event())
        assert hasattr(moe_utils, "te_general_gemm")
        with megatron_random.get_cuda_rng_tracker().fork():
            pass
    finally:
        cpu_patch.remove()
    assert not cpu_patch.applied
    assert (torch.cuda.current_device, torch.cuda.Stream, megatron_random._set_cuda_rng_state) == originals
    assert hasattr(moe_utils, "te_general_gemm") == had_gemm
    assert cpu_patch.remove() is False  # a second remove does nothing


def test_importing_the_patch_changes_nothing():
    code = (
        "import torch; before = torch.cuda.current_device\n"
        "import respo_verl.patches.megatron_core_0_16_1 as p\n"
        "print(torch.cuda.current_device is before, p.CPU.applied)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]
