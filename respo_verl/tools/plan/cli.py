"""``respo-verl plan PRESET [key=value ...]``: check a cluster preset and estimate per-GPU memory.

Exit status: 0 when every rule holds and every phase fits, 1 when a rule is violated (all of them are listed),
2 for bad input (unknown preset, malformed override or model config).

``--build`` instead has megatron-core build the preset's model and optimizer on the meta device, rank by rank, and
holds the planner to it (:mod:`respo_verl.tools.plan.build`): exit 0 when megatron builds it and every figure agrees,
1 when megatron refuses the layout or a figure disagrees, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf.errors import OmegaConfBaseException
from rich import box
from rich.console import Console
from rich.table import Table

from respo_verl import algorithms
from respo_verl.layout.models import SHIPPED_MODELS, ModelConfigError, ModelShape, shape_from_hf_config
from respo_verl.layout.parallel import Layout, LayoutError, layout_from_config
from respo_verl.layout.rules import Violation, check_layout, size_violations
from respo_verl.routing.mode import verl_mode
from respo_verl.run.jobcheck import check_job
from respo_verl.run.requirements import install_line, job_requirements
from respo_verl.tools.plan.checkpoints import checkpoint_plan
from respo_verl.tools.plan.memory import MemoryEstimate, estimate_memory, memory_violations
from respo_verl.tools.plan.presets import GPU_MEMORY_GIB, HOST_MEMORY_GIB, PRESETS, PresetError, compose_preset

EXIT_FITS, EXIT_VIOLATIONS, EXIT_BAD_INPUT = 0, 1, 2
TABLE_WIDTH = 120


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="respo-verl plan",
        description="Check a cluster layout preset against megatron-core/vLLM/verl rules and estimate per-GPU memory.",
        epilog=f"presets: {', '.join(PRESETS)}",
    )
    p.add_argument("preset", help="cluster preset name (configs/cluster/<name>.yaml)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.nnodes=2")
    p.add_argument("--model-config", help="HF config.json (or model directory) instead of the shipped facts")
    p.add_argument("--model", choices=sorted(SHIPPED_MODELS), help="shipped architecture (default: the preset's)")
    p.add_argument("--gpu-memory-gib", type=float, help="memory per GPU in GiB (default: the preset's GPU)")
    p.add_argument("--host-memory-gib", type=float, help="memory of the TaskRunner's node in GiB (default: the GPU's)")
    p.add_argument("--algorithm", default="respo", help="algorithm preset to compose with (default respo)")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument(
        "--build",
        action="store_true",
        help="build the model and optimizer with megatron-core on the meta device (fake world) and compare",
    )
    p.add_argument("--ranks", help="with --build: ranks to build, e.g. 0,7,12-15 (default: first, middle, last rank)")
    p.add_argument("--json", action="store_true", help="with --build: one JSON object per rank")
    p.add_argument("--workers", type=int, help="with --build: ranks built at once (default: up to 2 cores)")
    return p


def layout_summary(lay: Layout) -> str:
    if lay.backend == "megatron":
        vpp = f" VPP {lay.vpp}" if lay.vpp else ""
        train = f"Megatron TP {lay.tp} PP {lay.pp}{vpp} CP {lay.cp} EP {lay.ep} ETP {lay.etp} DP {lay.dp}"
    else:
        train = f"FSDP over {lay.world} (Ulysses SP {lay.ulysses_sp}, DP {lay.dp})"
    return f"{lay.nnodes}×{lay.gpus_per_node} GPUs; {train}; vLLM TP {lay.rollout_tp}"


def memory_table(name: str, lay: Layout, mem: MemoryEstimate, markdown: bool = False) -> Table:
    """One row per item of the estimate (GiB per GPU) against the GPU's capacity."""
    table = Table(
        title=f"{name}: {layout_summary(lay)}",
        box=box.MARKDOWN if markdown else box.SIMPLE_HEAVY,
        title_justify="left",
    )
    table.add_column("phase / item")
    table.add_column("GiB per GPU", justify="right")
    table.add_column("note")
    offload = []
    if lay.param_offload:
        offload.append("param_offload")
    if lay.optimizer_offload:
        offload.append("optimizer_offload")
    if mem.cpu_optimizer_gib:
        offload.append(f"CPU optimizer {lay.optimizer_cpu_offload_fraction:.0%}")
    recompute = lay.recompute_granularity or ("grad. checkpointing" if lay.gradient_checkpointing else "none")
    if lay.recompute_granularity == "full":
        recompute += f" ({lay.recompute_method}, {lay.recompute_num_layers})"
    rows = [
        ("weights", mem.weights_gib, f"{mem.params_per_gpu / 1e9:.2f} B params on this GPU"),
        ("gradients", mem.grads_gib, "fp32" if lay.backend == "megatron" else lay.model_dtype),
        ("optimizer", mem.optimizer_gib, f"{mem.cpu_optimizer_gib:.1f} GiB on CPU" if mem.cpu_optimizer_gib else ""),
        ("activations", mem.activations_gib, f"{lay.ppo_max_token_len_per_gpu} tokens/GPU, recompute {recompute}"),
        ("logits", mem.logits_gib, ""),
        ("runtime reserve", mem.reserve_gib, "CUDA context, NCCL, fragmentation"),
        ("= training step", mem.train_gib, "peak of the update"),
        ("old-log-prob forward", mem.logprob_gib, f"{lay.log_prob_max_token_len_per_gpu} tokens/GPU"),
        ("rollout: vLLM weights", mem.rollout_weights_gib, f"TP {lay.rollout_tp}"),
        ("rollout: KV cache", mem.rollout_kv_gib, f"~{mem.rollout_kv_tokens:,} tokens"),
        ("rollout: trainer resident", mem.rollout_resident_gib, ", ".join(offload) or "no offload"),
        (
            "vLLM start: free / needed",
            mem.rollout_startup_free_gib,
            f"needs {mem.rollout_startup_needed_gib:.1f} free; trainer holds {mem.rollout_startup_resident_gib:.1f}",
        ),
        (
            "= rollout",
            mem.rollout_gib,
            f"gpu_memory_utilization {lay.rollout_memory_fraction:.2f} + resident + reserve",
        ),
    ]
    if mem.host_offload_gib_per_node:
        rows.append(("host RAM per node (offload)", mem.host_offload_gib_per_node, "pinned CPU memory, whole node"))
    if mem.replay_step_gib:
        dtype = {1: "uint8", 2: "int16"}[mem.replay_index_bytes]
        store = mem.object_store_gib
        share = f"; {100 * mem.replay_step_gib / store:.0f}% of the object store ({store:.0f} GiB)" if store else ""
        mode = "R3 if on" if lay.replay == "off" else verl_mode(lay.replay)
        note = f"{mode}: {dtype}, ≤ {mem.replay_sample_mib:.1f} MiB/sample{share}"
        rows.append(("routing replay / step", mem.replay_step_gib, note))
    for item, gib, note in rows:
        table.add_row(item, f"{gib:.1f}", note)
    peak = mem.peak_gib
    table.add_row(
        "peak / capacity", f"{peak:.1f} / {mem.gpu_gib:.1f}", f"{100 * (1 - peak / mem.gpu_gib):.0f}% headroom"
    )
    return table


def plan(
    preset: str,
    overrides: list[str] | tuple[str, ...] = (),
    model: ModelShape | None = None,
    gpu_gib: float | None = None,
    algorithm: str = "respo",
    host_gib: float | None = None,
) -> tuple[Layout, MemoryEstimate | None, list[Violation], ModelShape]:
    """Compose ``preset`` with ``overrides`` and check it. Raises PresetError / ModelConfigError on bad input.

    The memory estimate is None when a count is below 1 (the ``world-size`` rule): nothing can be estimated.
    """
    cfg = compose_preset(preset, overrides, algorithm=algorithm)
    try:
        check_job(cfg, layout=False)  # what the run refuses; the layout rules are listed below, with the memory
    except ValueError as err:
        raise PresetError(str(err)) from None
    try:
        lay = layout_from_config(cfg)
    except (LayoutError, OmegaConfBaseException) as err:
        raise PresetError(f"preset {preset!r}: {err}") from None
    info = PRESETS.get(preset)
    if model is None:
        if info is None:
            raise PresetError(f"preset {preset!r} has no planner metadata; pass --model or --model-config")
        model = SHIPPED_MODELS[info.model]
    if gpu_gib is None:
        if info is None:
            raise PresetError(f"preset {preset!r} has no planner metadata; pass --gpu-memory-gib")
        gpu_gib = GPU_MEMORY_GIB[info.gpu]
    if host_gib is None:
        host_gib = HOST_MEMORY_GIB[info.gpu] if info is not None else 0.0
    sizes = size_violations(lay)
    if sizes:
        return lay, None, sizes, model
    mem = estimate_memory(model, lay, gpu_gib, host_gib)
    return lay, mem, check_layout(model, lay) + memory_violations(lay, mem), model


def _build(args: argparse.Namespace, lay: Layout, model: ModelShape) -> int:
    """``--build``: bad input is refused here, in one line, before any rank starts."""
    from respo_verl.tools.plan.build import (
        DEFAULT_WORKERS,
        BuildInputError,
        default_ranks,
        hf_config_from_shape,
        parse_ranks,
        run_build,
    )

    try:
        if lay.backend != "megatron":
            raise BuildInputError(
                f"--build builds Megatron presets; {args.preset} runs FSDP (docs/cluster.md, 'Built by megatron-core, "
                f"on CPU')"
            )
        if min(lay.world, lay.tp, lay.pp, lay.cp, lay.ep, lay.etp) < 1:
            raise BuildInputError(f"{args.preset}: the world and every parallel size must be >= 1")
        if args.workers is not None and args.workers < 1:
            raise BuildInputError(f"--workers must be >= 1, got {args.workers}")
        ranks = parse_ranks(args.ranks, lay.world) if args.ranks else default_ranks(lay)
        if args.model_config:
            hf_config = json.loads(_config_file(args.model_config).read_text())
        else:
            hf_config = hf_config_from_shape(model)
    except BuildInputError as e:
        print(f"respo-verl plan: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run_build(
        args.preset,
        tuple(args.overrides),
        args.algorithm,
        model,
        lay,
        hf_config,
        ranks,
        args.json,
        args.workers or DEFAULT_WORKERS,
        sys.stdout,
        sys.stderr,
    )


def _config_file(path: str) -> Path:
    p = Path(path).expanduser()
    return p / "config.json" if p.is_dir() else p


def _short(message: str) -> str:
    """Hydra's message for an unknown group option without the config search path it appends (5 providers)."""
    return message.split("; Config search path:", 1)[0]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        model = None
        if args.model_config:
            model = shape_from_hf_config(args.model_config)
        elif args.model:
            model = SHIPPED_MODELS[args.model]
        for flag in ("gpu_memory_gib", "host_memory_gib"):
            if getattr(args, flag) is not None and getattr(args, flag) <= 0:
                raise PresetError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
        if not args.build and (args.ranks or args.json or args.workers is not None):
            raise PresetError("--ranks, --json and --workers go with --build")
        if args.algorithm not in algorithms.NAMES:  # checked here: Hydra's refusal lists verl's presets too
            raise PresetError(f"--algorithm {args.algorithm}: no such algorithm (one of {', '.join(algorithms.NAMES)})")
        lay, mem, violations, model = plan(
            args.preset, args.overrides, model, args.gpu_memory_gib, args.algorithm, args.host_memory_gib
        )
    except (PresetError, ModelConfigError) as e:
        print(f"respo-verl plan: {_short(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.build:
        return _build(args, lay, model)
    out = Console(width=TABLE_WIDTH, highlight=False)
    if mem is None:
        out.print(f"{args.preset}: {lay.nnodes}×{lay.gpus_per_node} GPUs; no memory estimate", markup=False)
    else:
        out.print(memory_table(args.preset, lay, mem, markdown=args.markdown))
    out.print(
        f"model: {model.name}, {model.total_params / 1e9:.2f} B params ({model.active_params / 1e9:.2f} B active)"
    )
    cfg = compose_preset(args.preset, args.overrides, algorithm=args.algorithm)
    out.print(checkpoint_plan(model, lay, cfg).summary(), markup=False)
    # What every node must be able to import (the run's preflight checks it there before loading any model).
    out.print(install_line(job_requirements(cfg)), markup=False, soft_wrap=True)
    if violations:
        out.print(f"\nDOES NOT FIT / INVALID: {len(violations)} rule(s) violated", style="bold red")
        for v in violations:
            out.print(f"  - {v}", markup=False)
        return EXIT_VIOLATIONS
    out.print("OK: every rule holds and every phase fits", style="bold green")
    return EXIT_FITS


if __name__ == "__main__":
    sys.exit(main())
