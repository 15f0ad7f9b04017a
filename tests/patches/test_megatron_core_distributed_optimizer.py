"""megatron-core's distributed optimizer on CPU under the patch: a MoE GPTModel on two gloo ranks, Adam's state saved
in verl 0.9.1's default checkpoint format (``dp_reshardable``) and resumed exactly.

The layout is the shape of an upstream resume failure ("Cannot merge two lists with different lengths": the
distributed optimizer's ``dp_reshardable`` format, data parallel 2, parameters whose shards differ in length from rank
to rank). Each rank holds a different number of parameter pieces in a bucket, which the test checks before it relies on
it. Model, DDP wrapper, optimizer, checkpoint metadata and the sharded state dicts are built by verl's own functions;
the saves and loads are verl's ``save_dist_checkpointing`` / ``load_dist_checkpointing`` (megatron-core's fully
parallel strategies over the data-parallel group).
"""

from __future__ import annotations

import types

import pytest
import torch
from support.ranks import free_port, gloo_world, run_ranks

pytest.importorskip("megatron.core")

from respo_verl.patches.megatron_core_0_16_1 import CPU as cpu_patch
from respo_verl.patches.megatron_core_0_16_1 import DISTRIBUTED_OPTIMIZER

# Two layouts of the two ranks: expert parallel 1 (dense and expert parameters both sharded over data parallel 2) and
# expert parallel 2 (the layout of the CPU Megatron resume test: dense parameters over data parallel 2, each rank's
# experts its own).
EXPERT_PARALLEL_SIZES = (1, 2)
STEPS_BEFORE_SAVE = 3
LR = 1.0e-2
_TIMEOUT_S = 180


def test_the_patch_is_idempotent_removable_and_touches_only_the_optimizer_build():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = vars(DistributedOptimizer)["_build_model_and_main_param_groups"]
    assert DISTRIBUTED_OPTIMIZER.apply() is True
    try:
        patched = vars(DistributedOptimizer)["_build_model_and_main_param_groups"]
        assert DISTRIBUTED_OPTIMIZER.apply() is False and patched is not original
        assert vars(DistributedOptimizer)["_build_model_and_main_param_groups"] is patched
        # host tensors keep their own type name outside the optimizer's build
        assert torch.ones(1).type() == "torch.FloatTensor"
    finally:
        DISTRIBUTED_OPTIMIZER.remove()
    assert vars(DistributedOptimizer)["_build_model_and_main_param_groups"] is original
    assert not DISTRIBUTED_OPTIMIZER.applied and DISTRIBUTED_OPTIMIZER.remove() is False


@pytest.mark.slow
def test_adam_state_of_the_distributed_optimizer_resumes_exactly(tmp_path):
    """On each rank and layout: the fp32 main parameters, ``exp_avg``, ``exp_avg_sq`` and the step count loaded from
    the checkpoint equal the saved ones (``torch.equal``), and one more step from the original and from the resumed
    optimizer gives the same parameters and state, to the last bit."""
    run_ranks(_worker, (free_port(), str(tmp_path)), 2, _TIMEOUT_S, "the two-rank distributed optimizer resume")


# -- the ranks -----------------------------------------------------------------------------------------------------


def _worker(rank: int, port: int, folder: str) -> None:
    import os

    from megatron.core import parallel_state

    with gloo_world(rank, port, 2, _TIMEOUT_S // 2):
        try:
            cpu_patch.apply()
            DISTRIBUTED_OPTIMIZER.apply()
            for expert_parallel in EXPERT_PARALLEL_SIZES:
                parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=expert_parallel)
                try:
                    _save_resume_and_compare(rank, os.path.join(folder, f"ep{expert_parallel}"), expert_parallel)
                finally:
                    parallel_state.destroy_model_parallel()
        finally:
            DISTRIBUTED_OPTIMIZER.remove()
            cpu_patch.remove()


def _build(seed: int, expert_parallel: int):
    """The kit's tiny MoE GPTModel in megatron's DDP wrapper as mbridge's ``get_model`` wraps it for verl (verl passes
    ``use_distributed_optimizer``; mbridge adds ``grad_reduce_in_fp32`` and, without overlap, one bucket), and verl's
    optimizer for it (fp32, distributed, Adam)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from verl.utils.megatron.optimizer import get_megatron_optimizer, init_megatron_optim_config
    from verl.workers.config import McoreOptimizerConfig

    from respo_verl.cpu.kit.megatron_moe import tiny_gpt_moe

    model = tiny_gpt_moe(
        seed=seed,
        num_layers=2,
        num_moe_experts=4,
        expert_model_parallel_size=expert_parallel,
        moe_enable_routing_replay=False,
    )
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    ddp.broadcast_params()
    config = init_megatron_optim_config(McoreOptimizerConfig(lr=LR), use_distributed_optimizer=True, bf16=False)
    return ddp, get_megatron_optimizer(model=[ddp], config=config)


def _step(ddp, optimizer, rank: int, step: int) -> None:
    """One training step on this rank's own batch (data parallel: the ranks' batches differ)."""
    from respo_verl.cpu.kit.megatron_moe import BATCH, SEQ, VOCAB, forward

    generator = torch.Generator().manual_seed(1000 * step + rank)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)  # (B, T)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    logits = forward(ddp, input_ids)  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))
    loss.backward()
    ddp.finish_grad_sync()
    updated, _, _ = optimizer.step()
    assert updated, f"step {step} was skipped"


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    assert inner and all(isinstance(o, DistributedOptimizer) for o in inner), [type(o) for o in inner]
    return inner


def _adam_state(optimizer) -> list[tuple[str, torch.Tensor]]:
    """(name, copy) of every fp32 main-parameter shard and its Adam state, in the optimizers' own order."""
    state = []
    for i, distributed in enumerate(_distributed_optimizers(optimizer)):
        for g, group in enumerate(distributed.optimizer.param_groups):
            for p, main_param in enumerate(group["params"]):
                where = f"optimizer {i} group {g} param {p}"
                adam = distributed.optimizer.state[main_param]
                assert set(adam) == {"step", "exp_avg", "exp_avg_sq"}, (where, sorted(adam))
                state.append((f"{where} main_param", main_param.detach().clone()))
                state += [(f"{where} {key}", adam[key].detach().clone()) for key in ("step", "exp_avg", "exp_avg_sq")]
    return state


def _model_params(ddp) -> list[tuple[str, torch.Tensor]]:
    return [(name, param.detach().clone()) for name, param in ddp.module.named_parameters()]


def _assert_equal(expected, actual, what: str) -> None:
    assert [name for name, _ in expected] == [name for name, _ in actual], what
    unequal = [(name, a, b) for (name, a), (_, b) in zip(expected, actual, strict=True) if not torch.equal(a, b)]
    first = [f"{name}: {a.flatten()[:3].tolist()} != {b.flatten()[:3].tolist()}" for name, a, b in unequal[:2]]
    assert not unequal, f"{what}: {len(unequal)} of {len(expected)} tensors differ, first {first}"


def _shard_lengths(optimizer) -> list[list[int]]:
    """Per distributed optimizer: the lengths of this rank's pieces of parameters in its buckets."""
    return [
        [len(ranges["param"]) for bucket in gbuf[dtypes] for ranges in bucket["param_map"].values()]
        for distributed in _distributed_optimizers(optimizer)
        for gbuf in distributed.gbuf_ranges
        for dtypes in gbuf
    ]


def _checkpoint_manager(ddp, optimizer):
    """What verl's ``MegatronCheckpointManager`` reads from itself when it builds metadata and sharded state dicts
    (its actor role, verl's default engine config: the distributed optimizer's default checkpoint format)."""
    from verl.workers.config import McoreEngineConfig

    engine = McoreEngineConfig()
    assert engine.use_distributed_optimizer and not engine.dist_ckpt_optim_fully_reshardable
    return types.SimpleNamespace(
        model=[ddp],
        optimizer=optimizer,
        lr_scheduler=None,
        use_megatron_fsdp=False,
        use_distributed_optimizer=True,
        role="actor",
        config=types.SimpleNamespace(actor=types.SimpleNamespace(megatron=engine)),
    )


def _save_resume_and_compare(rank: int, folder: str, expert_parallel: int) -> None:
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager as Manager
    from verl.utils.megatron.dist_checkpointing import load_dist_checkpointing, save_dist_checkpointing

    ddp, optimizer = _build(seed=0, expert_parallel=expert_parallel)
    for step in range(STEPS_BEFORE_SAVE):
        _step(ddp, optimizer, rank, step)

    # The upstream failure's shape: the two data-parallel ranks hold different numbers of parameter pieces (the
    # length of the per-rank list the dp_reshardable format saves) in the dense parameters' bucket.
    lengths = [None, None]
    dist.all_gather_object(lengths, _shard_lengths(optimizer))
    assert len(lengths[0][0]) != len(lengths[1][0]), f"the ranks hold as many pieces: {lengths}"

    model_dir, optim_dir = os.path.join(folder, "model"), os.path.join(folder, "optimizer")
    for path in (model_dir, optim_dir):
        os.makedirs(path, exist_ok=True)
    manager = _checkpoint_manager(ddp, optimizer)
    metadata = Manager._build_sharded_state_dict_metadata(manager)
    assert metadata["distrib_optim_sharding_type"] == "dp_reshardable", metadata
    model_state = Manager._build_model_sharded_state_dict(manager, metadata)
    save_dist_checkpointing(model_state, model_dir, content_metadata=metadata)
    save_dist_checkpointing(
        Manager._build_optimizer_state_dict(manager, model_state, metadata), optim_dir, content_metadata=metadata
    )
    saved_adam, saved_params = _adam_state(optimizer), _model_params(ddp)
    assert all(int(t.item()) == STEPS_BEFORE_SAVE for name, t in saved_adam if name.endswith(" step"))

    # A fresh model (other initial weights) and optimizer (no state), loaded as verl loads a checkpoint.
    resumed_ddp, resumed = _build(seed=1, expert_parallel=expert_parallel)
    manager = _checkpoint_manager(resumed_ddp, resumed)
    loaded_metadata = dist_checkpointing.load_content_metadata(checkpoint_dir=optim_dir)
    assert loaded_metadata == metadata, loaded_metadata
    model_state = Manager._build_model_sharded_state_dict(manager, loaded_metadata)
    resumed_ddp.load_state_dict(load_dist_checkpointing(model_state, model_dir)["model"], strict=True)
    optim_state = Manager._build_optimizer_state_dict(manager, model_state, loaded_metadata, is_loading=True)
    resumed.load_state_dict(load_dist_checkpointing(optim_state, optim_dir)["optimizer"])

    where = f"rank {rank}, expert parallel {expert_parallel}"
    _assert_equal(saved_params, _model_params(resumed_ddp), f"{where}: model parameters after the load")
    _assert_equal(saved_adam, _adam_state(resumed), f"{where}: Adam's state after the load")

    _step(ddp, optimizer, rank, STEPS_BEFORE_SAVE)
    _step(resumed_ddp, resumed, rank, STEPS_BEFORE_SAVE)
    _assert_equal(_model_params(ddp), _model_params(resumed_ddp), f"{where}: parameters one step after the resume")
    _assert_equal(_adam_state(optimizer), _adam_state(resumed), f"{where}: Adam's state one step after the resume")
