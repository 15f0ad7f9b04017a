"""``respo-verl mini``: the paper's experiment in miniature on CPU (tiny Qwen3, rollout reuse N).

Quick mode (default): the four algorithms at N = 32, one seed, 1024 optimizer steps each (the paper's update
count), about two minutes on 2 CPU cores. ``--full``: {grpo, gspo, vespo, respo} × N ∈ {8, 16, 32} × 3 seeds.
Writes the JSONL logs (verl's file-logger format), ``results.md`` (the table) and ``scores.png`` to the output
directory it prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

QUICK_REUSE = (32,)
FULL_REUSE = (8, 16, 32)
FULL_SEEDS = 3
ALGORITHMS = ("grpo", "gspo", "vespo", "respo")  # equal to respo_verl.verl.experiment.ALGORITHMS (tested)
# SPEC §5: 1024 optimizer updates per run.
DEFAULT_OPTIMIZER_STEPS = 1024
# Prompts per mini-batch (the paper uses 32 with a 1.7B model; 2 prompts × G = 8 keep one update ~40 ms here).
DEFAULT_MINIBATCH_PROMPTS = 2
# Peak AdamW learning rate: the base model learns within 1024 updates and 31 stale updates move it far enough that
# long responses drift to log W < −1. Fixed from short ReSPO-only probes before any comparison (1e-3 stalled; 1e-4
# learned too but drifted less).
DEFAULT_LR = 3e-4
USAGE_ERROR = 2


class UsageError(ValueError):
    """An invalid option: reported before any work starts, exit code 2."""


def _algorithms(text: str) -> list[str]:
    names = [a.strip() for a in text.replace(" ", ",").split(",") if a.strip()]
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="respo-verl mini",
        description=" ".join(__doc__.split("\n\n")[:2]).replace("\n", " ").replace("``", ""),
    )
    parser.add_argument("--full", action="store_true", help="all algorithms × N ∈ {8, 16, 32} × 3 seeds")
    parser.add_argument(
        "--algos",
        type=_algorithms,
        default=None,
        help=f"comma-separated subset of {','.join(ALGORITHMS)} (default all)",
    )
    parser.add_argument("--reuse", type=int, nargs="+", default=None, metavar="N", help="rollout reuse N (default 32)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds 0..S-1 (default 1; --full 3)")
    parser.add_argument("--optimizer-steps", type=int, default=DEFAULT_OPTIMIZER_STEPS, help="updates per run")
    parser.add_argument(
        "--minibatch-prompts", type=int, default=DEFAULT_MINIBATCH_PROMPTS, help="prompts per mini-batch (P = this × N)"
    )
    parser.add_argument(
        "--rollout-prompts", type=int, default=None, help="prompts per rollout batch P (must be a multiple of every N)"
    )
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt G")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help="peak AdamW learning rate")
    parser.add_argument("--moe", action="store_true", help="tiny Qwen3-MoE (4 experts, top-2) instead of dense")
    parser.add_argument(
        "--routing-replay",
        action="store_true",
        help="R2 routing replay with --moe: replay the π_old forward's experts in every update of the rollout batch",
    )
    parser.add_argument(
        "--warm-start-steps",
        type=int,
        default=None,
        help="supervised warm-start steps (default 1000, ~35 s once, then cached)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output directory (default ./outputs/mini/<timestamp>)")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="base-model cache (default ~/.cache/respo_verl/mini)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (results are exact for a given count)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill mode defaults and check every option; raise :class:`UsageError` with a clear message."""
    if args.routing_replay and not args.moe:
        raise UsageError("--routing-replay replays the experts of an MoE model: it needs --moe")
    args.algos = list(args.algos) if args.algos is not None else list(ALGORITHMS)
    unknown = [a for a in args.algos if a not in ALGORITHMS]
    if unknown or not args.algos:
        raise UsageError(f"unknown algorithm(s) {unknown or args.algos}; choose from {', '.join(ALGORITHMS)}")
    args.algos = list(dict.fromkeys(args.algos))
    args.reuse = sorted(set(args.reuse)) if args.reuse is not None else list(FULL_REUSE if args.full else QUICK_REUSE)
    if any(n < 1 for n in args.reuse):
        raise UsageError(f"--reuse values must be >= 1, got {args.reuse}")
    args.seeds = args.seeds if args.seeds is not None else (FULL_SEEDS if args.full else 1)
    if args.seeds < 1:
        raise UsageError(f"--seeds must be >= 1 (number of seeds), got {args.seeds}")
    if args.group_size < 2:
        raise UsageError(f"--group-size must be >= 2 (GRPO needs a group to compare with), got {args.group_size}")
    if args.minibatch_prompts < 1:
        raise UsageError(f"--minibatch-prompts must be >= 1, got {args.minibatch_prompts}")
    if args.rollout_prompts is not None:
        if args.rollout_prompts < 1:
            raise UsageError(f"--rollout-prompts must be >= 1, got {args.rollout_prompts}")
        bad = [n for n in args.reuse if args.rollout_prompts % n]
        if bad:
            raise UsageError(
                f"N = {bad} does not divide the rollout batch of {args.rollout_prompts} prompts; every mini-batch "
                "must hold whole prompt groups (choose P a multiple of N, or omit --rollout-prompts)"
            )
    bad = [n for n in args.reuse if args.optimizer_steps % n or args.optimizer_steps < n]
    if args.optimizer_steps < 1 or bad:
        raise UsageError(
            f"--optimizer-steps {args.optimizer_steps} must be a positive multiple of every N (not of {bad}): "
            "each training step applies exactly N updates"
        )
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.warm_start_steps is not None and args.warm_start_steps < 0:
        raise UsageError(f"--warm-start-steps must be >= 0, got {args.warm_start_steps}")
    if args.out is None:
        args.out = Path("outputs") / "mini" / time.strftime("%Y%m%d-%H%M%S")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} exists and is not a directory")
    return args


def _manifest_record(cfg, log_path: Path, out: Path, spec, warm, argv: list[str]):
    """The run's manifest entry, so that ``respo-verl report`` reads the logs as it reads a sweep's."""
    import hashlib
    import importlib.metadata

    from respo_verl.sweep.manifest import RunRecord

    # Everything that defines the run except its seed: seeds of one setting share the hash.
    setting = {k: v for k, v in asdict(cfg).items() if k != "seed"} | {"model": asdict(spec), "warm": asdict(warm)}
    return RunRecord(
        name=cfg.name,
        algorithm=cfg.algorithm,
        reuse=cfg.reuse,
        seed=cfg.seed,
        log=str(log_path.resolve().relative_to(out)),
        optimizer_steps=cfg.optimizer_steps,
        config_hash=hashlib.sha256(json.dumps(setting, sort_keys=True, default=str).encode()).hexdigest(),
        command=["respo-verl", "mini", *argv],
        versions={"respo-verl": importlib.metadata.version("respo-verl")},
        source="mini",
        log_step="optimizer",
    )


def rollout_prompts(args: argparse.Namespace, reuse: int) -> int:
    return args.rollout_prompts if args.rollout_prompts is not None else args.minibatch_prompts * reuse


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = resolve(parser.parse_args(argv))
    except UsageError as exc:
        print(f"respo-verl mini: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exc:  # argparse: --help (0) or a malformed option (2), message already printed
        return int(exc.code or 0)
    return run(args, argv)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    # verl and megatron-core warn at import about engines and fused kernels a CPU run does not use.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(verl|megatron)(\.|$)")
    import torch
    from tqdm import tqdm

    from respo_verl.mini import model as model_lib
    from respo_verl.mini import report
    from respo_verl.mini.train import RunConfig, train
    from respo_verl.sweep.manifest import write_manifest

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"respo-verl mini: writing to {out}", flush=True)
    spec = model_lib.ModelSpec(moe=args.moe)
    warm = model_lib.WarmStart() if args.warm_start_steps is None else model_lib.WarmStart(steps=args.warm_start_steps)
    start = time.perf_counter()
    base, origin = model_lib.warm_start(spec, warm, args.cache_dir or model_lib.DEFAULT_CACHE_DIR)
    print(
        f"base model ({'Qwen3-MoE' if args.moe else 'Qwen3'}, {sum(p.numel() for p in base.parameters())} "
        f"parameters): {origin} [{time.perf_counter() - start:.1f} s]",
        flush=True,
    )
    configs = [
        RunConfig(
            algo,
            n,
            seed,
            args.optimizer_steps,
            rollout_prompts(args, n),
            args.group_size,
            args.lr,
            routing_replay=args.routing_replay,
        )
        for n in args.reuse
        for seed in range(args.seeds)
        for algo in args.algos
    ]
    summaries, series, records = [], {}, []
    bar = tqdm(total=sum(c.optimizer_steps for c in configs), unit="upd", disable=args.no_progress, file=sys.stderr)
    for cfg in configs:
        bar.set_description(cfg.name)
        result = train(cfg, base, out, on_step=lambda _: bar.update(1))
        summaries.append(report.summarize_run(cfg.algorithm, cfg.reuse, cfg.seed, result.records))
        series.setdefault((cfg.algorithm, cfg.reuse), []).append([r["data"]["mini/score"] for r in result.records])
        records.append(_manifest_record(cfg, result.log_path, out, spec, warm, argv))
    bar.close()
    manifest = write_manifest(records, out)
    wall = time.perf_counter() - start
    command = "respo-verl mini " + shlex.join(argv)
    table = report.markdown_table(summaries)
    model_name = ("Qwen3-MoE" if args.moe else "Qwen3") + (", R2 routing replay" if args.routing_replay else "")
    title = f"respo-verl mini ({model_name}, G={args.group_size}, {args.optimizer_steps} updates, lr {args.lr:g})"
    png = report.plot_scores(series, out / "scores.png", title)
    header = [
        f"# {title}",
        "",
        f"command: `{command}`  ",
        f"runs: {len(configs)}, total wall time {wall:.0f} s ({args.threads} torch thread(s)), base model: {origin}",
        "",
        "Scores are (reward+1)/2 of the rollout batches, in % (mean ± standard error over seeds). Early/late: first/"
        "last quarter of the optimizer steps. Starvation (SPEC §4): positive responses with log W < −1, as a share of "
        "the responses and of the gradient mass Σ|∂loss/∂log π|, averaged over the stale half of every rollout batch "
        "(mini-batches j ≥ N/2).",
        "",
    ]
    (out / "results.md").write_text("\n".join([*header, table, ""]))
    (out / "summary.json").write_text(
        json.dumps(
            {"command": command, "wall_s": wall, "runs": [asdict(s) for s in summaries], "base_model": origin},
            indent=2,
        )
    )
    print(table)
    print(f"\ntotal {wall:.0f} s; table {out / 'results.md'}; plot {png}; logs {out / 'respo_verl_mini'}")
    print(f"comparison report of these logs: respo-verl report {shlex.quote(str(manifest.parent))}")
    return 0
