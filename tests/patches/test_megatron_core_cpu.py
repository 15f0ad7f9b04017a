"""The CPU patch of megatron-core 0.16.1: applied only when asked, idempotent, undone by ``remove()``; a fully parallel
checkpoint load on two gloo ranks under it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from support.ranks import free_port, gloo_world, run_ranks

pytest.importorskip("megatron.core")

from megatron.core.dist_checkpointing import exchange_utils
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer.moe import moe_utils

from respo_verl.patches.megatron_core_0_16_1 import CPU as cpu_patch


def test_apply_is_idempotent_and_remove_restores_every_original():
    originals = (
        torch.cuda.current_device,
        torch.cuda.Stream,
        megatron_random._set_cuda_rng_state,
        exchange_utils.exchange_loaded_tensors_broadcast,
    )
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
        # a fully parallel checkpoint load exchanges its shards as host tensors (no .cuda())
        assert exchange_utils.exchange_loaded_tensors_broadcast is exchange_utils.exchange_loaded_tensors_gather_object
    finally:
        cpu_patch.remove()
    assert not cpu_patch.applied
    assert (
        torch.cuda.current_device,
        torch.cuda.Stream,
        megatron_random._set_cuda_rng_state,
        exchange_utils.exchange_loaded_tensors_broadcast,
    ) == originals
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


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_torch_stand_in_moves_cuda_factories_only(device):
    """One stand-in for the CPU patch (device cpu) and the meta build (device meta): a factory called with
    ``device='cuda'`` builds on ``device``; another device, no device and every other name are torch's own."""
    from respo_verl.patches import meta_build
    from respo_verl.patches.megatron_core_0_16_1 import TorchOnDevice

    stand_in = TorchOnDevice(torch, device)
    for name in TorchOnDevice.FACTORIES:
        factory = getattr(stand_in, name)
        assert factory.__name__ == getattr(torch, name).__name__
        if name.endswith("_like"):
            made = factory(torch.ones(3), device="cuda:0")
            assert made.device.type == device and made.shape == (3,)
            continue
        args = ([1.0, 2.0],) if name == "tensor" else ((2,), 0.5) if name == "full" else ((2,),)
        assert factory(*args, device="cuda").device.type == device
        assert factory(*args, device="cpu").device.type == "cpu"
        assert factory(*args).device.type == "cpu"
    assert stand_in.float32 is torch.float32 and stand_in.cat is torch.cat
    assert meta_build.TorchOnDevice is TorchOnDevice  # the meta build's stand-in is this one


_LOAD_TIMEOUT_S = 120


@pytest.mark.slow
def test_a_fully_parallel_checkpoint_load_exchanges_its_shards_on_cpu(tmp_path):
    """Two gloo ranks save replicated tensors with megatron's dist checkpointing and load them back the way verl
    loads a Megatron checkpoint (``FullyParallelLoadStrategyWrapper`` over the data-parallel ranks): each rank reads
    half of the tensors and receives the other half from the other rank. Without the patch's exchange, the
    broadcast's ``.cuda()`` fails on CPU (checked: ``Found no NVIDIA driver``)."""
    run_ranks(_load_worker, (free_port(), str(tmp_path)), 2, _LOAD_TIMEOUT_S, "the two-rank load")


def _load_worker(rank: int, port: int, folder: str) -> None:
    with gloo_world(rank, port, 2, _LOAD_TIMEOUT_S // 2):
        _save_and_load_replicated(rank, folder)


def _save_and_load_replicated(rank: int, folder: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    try:
        cpu_patch.apply()
        # four tensors, each replicated on both ranks (replica_id = rank): the fully parallel load reads each once
        saved = {f"t{i}": torch.arange(6, dtype=torch.float32) * (i + 1) for i in range(4)}

        def sharded(tensors):
            return {key: ShardedTensor.from_rank_offsets(key, value, replica_id=rank) for key, value in tensors.items()}

        dist_checkpointing.save(sharded(saved), folder)
        strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), dist.group.WORLD)
        loaded = dist_checkpointing.load(
            sharded({k: torch.zeros_like(v) for k, v in saved.items()}), folder, sharded_strategy=strategy
        )
        assert sorted(loaded) == sorted(saved)
        for key, tensor in saved.items():
            assert loaded[key].device.type == "cpu" and torch.equal(loaded[key], tensor), key
    finally:
        cpu_patch.remove()
