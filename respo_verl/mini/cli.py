"""``respo-verl mini``: the paper's experiment in miniature on CPU (tiny Qwen3, rollout reuse N, long answers).

Quick mode (default): the four algorithms at N = 32, one seed, 192 updates, at the protocol's quick learning rate
(a smoke run with the regime checks, not a comparison). ``--full``: the learning-rate grid at N = 32 for every
algorithm with one RL seed per warm start; then, at the common learning rate (chosen on the baselines only, among
the rates in the paper's regime), ReSPO and VESPO with 8 seeds (2 warm starts × 4 RL seeds) at N = 32 and 2 seeds at
N ∈ {8, 16}
(``respo_verl.mini.protocol``). Every run prints and logs the regime checks (``respo_verl.mini.regime``); the scores
are ``respo-verl report``'s (late = last 128 updates).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from respo_verl import algorithms
from respo_verl.mini import protocol
from respo_verl.runs.options import reuse_list, seed_list

USAGE_ERROR = 2
# Metrics `respo-verl report` tabulates for the miniature (mean over the run): clipped gradient norms, the task.
REPORT_METRICS = (
    "mini/grad_clipped",
    "mini/gave_up_frac",
    "mini/slipped_frac",
    "mini/response_length/correct_mean",
    "mini/response_length/wrong_mean",
)


class UsageError(ValueError):
    """An invalid option: reported before any work starts, exit code 2."""


def _algorithms(text: str) -> tuple[str, ...]:
    try:
        return algorithms.parse_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lr_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated learning rates such as 1e-4,3e-4, got {text!r}"
        ) from None
    if not all(v > 0 and math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"learning rates must be positive numbers, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"list {text!r} repeats a value")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="respo-verl mini", description=" ".join(__doc__.split("\n\n")[:2]).replace("\n", " ").replace("``", "")
    )
    parser.add_argument("--full", action="store_true", help="the protocol's full grid (learning rates, N, 8 seeds)")
    parser.add_argument("--algos", type=_algorithms, default=None, help="comma-separated (default: all four)")
    parser.add_argument("--reuse", type=reuse_list, default=None, metavar="N,...", help="rollout reuse (default 32)")
    parser.add_argument("--seeds", type=seed_list, default=None, metavar="S,...", help="RL seeds (default 0)")
    parser.add_argument(
        "--lr", type=_lr_list, default=None, metavar="LR,...", help=f"learning rates (default {protocol.QUICK_LR:g})"
    )
    parser.add_argument(
        "--optimizer-steps",
        type=int,
        default=None,
        help=f"updates per run (default {protocol.QUICK_OPTIMIZER_STEPS}; --full {protocol.FULL_OPTIMIZER_STEPS})",
    )
    parser.add_argument(
        "--minibatch-prompts", type=int, default=protocol.MINIBATCH_PROMPTS, help="prompts per mini-batch"
    )
    parser.add_argument("--group-size", type=int, default=protocol.GROUP_SIZE, help="responses per prompt G")
    parser.add_argument("--moe", action="store_true", help="tiny Qwen3-MoE (4 experts, top-2) instead of dense")
    parser.add_argument(
        "--routing-replay",
        action="store_true",
        help="R2 routing replay with --moe: replay the π_old forward's experts in every update of the rollout batch",
    )
    parser.add_argument("--warm-start-steps", type=int, default=None, help="supervised warm-start steps")
    parser.add_argument(
        "--train-base",
        action="store_true",
        help="train the base model(s) here (then cached) instead of loading the ones shipped with the package",
    )
    parser.add_argument("--out", type=Path, default=None, help="output directory (default ./outputs/mini/<timestamp>)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="base-model cache (~/.cache/respo_verl/mini)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads per run (numbers are exact per count)"
    )
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel processes (default 2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def _check_out(path: Path) -> None:
    """One line when ``path`` cannot become the output directory (a file, under a file, not writable)."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {path} exists and is not a directory")
    parent = path.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--out {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: {parent} is not writable")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill mode defaults and check every option; raise :class:`UsageError` with a clear message."""
    if args.routing_replay and not args.moe:
        raise UsageError("--routing-replay replays the experts of an MoE model: it needs --moe")
    args.algos = list(args.algos or algorithms.ALGORITHMS)
    if args.full and any(v is not None for v in (args.reuse, args.seeds, args.lr, args.optimizer_steps)):
        raise UsageError("--full runs the protocol's grid: it takes no --reuse, --seeds, --lr or --optimizer-steps")
    if args.optimizer_steps is None:
        args.optimizer_steps = protocol.FULL_OPTIMIZER_STEPS if args.full else protocol.QUICK_OPTIMIZER_STEPS
    args.reuse = sorted(args.reuse or (protocol.FULL_REUSE if args.full else protocol.QUICK_REUSE))
    args.seeds = list(args.seeds or (protocol.FULL_SEEDS if args.full else protocol.QUICK_SEEDS))
    args.lr = list(args.lr or (protocol.LR_GRID if args.full else (protocol.QUICK_LR,)))
    if args.full and protocol.GRID_REUSE not in args.reuse:
        raise UsageError(f"--full chooses learning rates at N = {protocol.GRID_REUSE}")
    if args.group_size < 2:
        raise UsageError(f"--group-size must be >= 2 (GRPO needs a group to compare with), got {args.group_size}")
    if args.minibatch_prompts < 1:
        raise UsageError(f"--minibatch-prompts must be >= 1, got {args.minibatch_prompts}")
    bad = [n for n in args.reuse if args.optimizer_steps % n or args.optimizer_steps < n]
    if args.optimizer_steps < 1 or bad:
        raise UsageError(
            f"--optimizer-steps {args.optimizer_steps} must be a positive multiple of every N (not of {bad}): "
            "each training step applies exactly N updates"
        )
    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if args.warm_start_steps is not None and args.warm_start_steps < 0:
        raise UsageError(f"--warm-start-steps must be >= 0, got {args.warm_start_steps}")
    if args.out is None:
        args.out = Path("outputs") / "mini" / time.strftime("%Y%m%d-%H%M%S")
    _check_out(args.out)
    return args


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = resolve(parser.parse_args(argv))
    except UsageError as exc:
        print(f"respo-verl mini: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exc:  # argparse: --help (0) or a malformed option (2), message already printed
        return int(exc.code or 0)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"respo-verl mini: error: --out {args.out}: cannot create it ({exc.strerror or exc})", file=sys.stderr)
        return USAGE_ERROR
    return run(args, argv)


def machine(threads: int) -> dict[str, str]:
    """What the numbers depend on besides the seed: CPU model, torch version and threads (exact per machine)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": str(os.cpu_count()), "torch": torch.__version__, "torch_threads": str(threads)}


@dataclass(frozen=True)
class _Job:
    """Everything a worker process needs to run one configuration."""

    cfg: object  # RunConfig (imported lazily: torch)
    spec: object
    warm: object
    cache_dir: Path
    out: Path
    threads: int
    shipped: bool


def _quiet() -> None:
    """Keep import-time notices of verl, megatron-core and transformers (engines and kernels a CPU run does not use)
    out of the progress bars."""
    import logging

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("verl", "megatron", "transformers", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def _preload(algos: list[str]) -> None:
    """Compose each algorithm and call verl's advantage path once, with verl's logging off: verl reports on first use
    that it found no accelerator (expected on CPU), which would otherwise break into the progress bars."""
    import logging

    import torch

    from respo_verl.verl import experiment

    logging.disable(logging.WARNING)
    try:
        for algo in algos:
            setup = experiment.load_algorithm(algo)
            mask = torch.ones(2, 1, dtype=torch.bool)
            experiment.compute_advantages(setup, torch.tensor([[1.0], [-1.0]]), mask, ["a", "a"])
    finally:
        logging.disable(logging.NOTSET)


def _init_worker(threads: int, algos: list[str]) -> None:
    import torch

    _quiet()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    _preload(algos)


def _run_job(job: _Job, progress=None) -> dict:
    """Train one configuration (in this or a worker process) and return what the summary needs."""
    from respo_verl.mini import model as model_lib
    from respo_verl.mini import regime
    from respo_verl.mini.train import train

    base, _ = model_lib.warm_start(job.spec, job.warm, job.cache_dir, shipped=job.shipped)
    pending = [0]

    def tick(step: int) -> None:
        pending[0] += 1
        if progress is not None and (pending[0] >= 16 or step == job.cfg.optimizer_steps):
            progress.put(pending[0])
            pending[0] = 0

    result = train(job.cfg, base, job.out, on_step=tick)
    data = [r["data"] for r in result.records]
    quarter = data[-max(1, len(data) // 4) :]
    correct = [d["mini/response_length/correct_mean"] for d in quarter]
    wrong = [d["mini/response_length/wrong_mean"] for d in quarter]
    correct = [v for v in correct if not math.isnan(v)]
    wrong = [v for v in wrong if not math.isnan(v)]
    return {
        "name": job.cfg.name,
        "log": str(result.log_path),
        "regime": asdict(result.regime),
        "regime_line": result.regime.line(),
        "holds": result.regime.holds,
        "stale_totals": regime.stale_totals(job.cfg.reuse, result.records),
        "stale_shares": result.stale_single_token_shares,
        "first_score": data[0]["mini/score"],
        "last_quarter_length_ratio": (
            statistics.fmean(correct) / statistics.fmean(wrong) if correct and wrong else math.nan
        ),
        "last_quarter_correct_length": statistics.fmean(correct) if correct else math.nan,
        "wall_s": result.wall_s,
    }


def _execute(jobs: list[_Job], workers: int, bar) -> list[dict]:
    """Run ``jobs`` in ``workers`` processes (in this process for one), updating ``bar`` as updates complete."""
    if workers == 1 or len(jobs) == 1:
        out = []
        for job in jobs:
            bar.set_description(job.cfg.name)
            out.append(_run_job(job, _BarQueue(bar)))
        return out
    import multiprocessing
    import queue
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    context = multiprocessing.get_context("spawn")
    with (
        context.Manager() as manager,
        ProcessPoolExecutor(
            max_workers=min(workers, len(jobs)),
            mp_context=context,
            initializer=_init_worker,
            initargs=(jobs[0].threads, sorted({j.cfg.algorithm for j in jobs})),
        ) as pool,
    ):
        progress = manager.Queue()
        futures = {pool.submit(_run_job, job, progress): i for i, job in enumerate(jobs)}
        results: list[dict | None] = [None] * len(jobs)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            while True:
                try:
                    bar.update(progress.get_nowait())
                except queue.Empty:
                    break
            for future in done:
                results[futures[future]] = future.result()
                bar.set_description(f"{sum(r is not None for r in results)}/{len(jobs)} runs")
    return results


class _BarQueue:
    def __init__(self, bar) -> None:
        self.bar = bar

    def put(self, n: int) -> None:
        self.bar.update(n)


def _config_hash(cfg) -> str:
    """Everything that defines a setting except its seeds: the seeds of one setting share the hash."""
    setting = {k: v for k, v in asdict(cfg).items() if k not in ("seed", "warm_seed")}
    return hashlib.sha256(json.dumps(setting, sort_keys=True, default=str).encode()).hexdigest()


def _record(cfg, log: str, out: Path, argv: list[str], versions: dict[str, str]):
    from respo_verl.runs.manifest import RunRecord

    return RunRecord(
        name=cfg.name,
        algorithm=cfg.algorithm,
        reuse=cfg.reuse,
        seed=cfg.seed,
        log=str(Path(log).resolve().relative_to(out)),
        optimizer_steps=cfg.optimizer_steps,
        config_hash=_config_hash(cfg),
        command=["respo-verl", "mini", *argv],
        versions=versions,
        source="mini",
        log_step="optimizer",
    )


def grid_regime(done) -> dict:
    """(algorithm, lr) → the regime checks of the grid runs at N = GRID_REUSE, pooled over their seeds."""
    from respo_verl.mini import regime

    runs = defaultdict(list)
    for cfg, result in done:
        if cfg.reuse == protocol.GRID_REUSE:
            runs[(cfg.algorithm, cfg.lr)].append((result["stale_totals"], result["stale_shares"]))
    return {key: regime.pool(protocol.GRID_REUSE, parts) for key, parts in runs.items()}


def late_scores(records, out: Path) -> dict[tuple[str, float], float]:
    """(algorithm, lr) → mean late score over seeds, from the logs (``respo_verl.runs.stats``)."""
    from respo_verl.runs.logs import read_log
    from respo_verl.runs.stats import score_curve, window_stats

    by_setting = defaultdict(list)
    for record, cfg in records:
        curve, _ = score_curve(read_log(out / record.log), record.reuse, "optimizer")
        by_setting[(cfg.algorithm, cfg.lr)].append(window_stats(curve).late)
    return {k: statistics.fmean(v) for k, v in by_setting.items()}


def _report_view(name: str, records, out: Path) -> tuple[str, Path]:
    """``respo-verl report`` on a subset of the runs (its own manifest under ``out/report/<name>``)."""
    from respo_verl.report.cli import build_report
    from respo_verl.runs.logs import read_log
    from respo_verl.runs.manifest import write_manifest
    from respo_verl.runs.stats import SCORE_KEY

    view = out / "report" / name
    absolute = [type(r)(**{**asdict(r), "log": str((out / r.log).resolve())}) for r in records]
    manifest = write_manifest(absolute, view)
    logged = {k for r in absolute for k in read_log(Path(r.log)).metrics}  # a metric NaN throughout is left out
    args = argparse.Namespace(
        paths=[Path(r.log) for r in absolute],
        manifest=[manifest],
        out=view,
        score_key=SCORE_KEY,
        reward_range="pm1",
        metric=[m for m in REPORT_METRICS if m in logged],
        no_plots=False,
    )
    text, _ = build_report(args)
    return text, view / "report.md"


def run(args: argparse.Namespace, argv: list[str]) -> int:
    _quiet()
    import importlib.metadata

    import torch
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from respo_verl.mini import model as model_lib
    from respo_verl.mini.train import RunConfig
    from respo_verl.runs.manifest import write_manifest

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    out = args.out.resolve()
    print(f"respo-verl mini: writing to {out}", flush=True)
    host = machine(args.threads)
    versions = {"respo-verl": importlib.metadata.version("respo-verl"), **host}
    (out / "machine.json").write_text(json.dumps(host, indent=2) + "\n")
    spec = model_lib.ModelSpec(moe=args.moe)
    cache_dir = args.cache_dir or model_lib.DEFAULT_CACHE_DIR
    warm_steps = {} if args.warm_start_steps is None else {"steps": args.warm_start_steps}
    warms = {w: model_lib.WarmStart(seed=w, **warm_steps) for w in sorted({protocol.warm_seed(s) for s in args.seeds})}
    start = time.perf_counter()
    with logging_redirect_tqdm():
        for w, warm in warms.items():
            with tqdm(total=warm.steps, unit="step", disable=args.no_progress, file=sys.stderr) as bar:
                bar.set_description(f"warm start {w}")
                _, origin = model_lib.warm_start(
                    spec, warm, cache_dir, on_step=lambda _: bar.update(1), shipped=not args.train_base
                )
            print(f"base model {w} ({'Qwen3-MoE' if args.moe else 'Qwen3'}): {origin}", flush=True)
        _preload(args.algos)

        def configs(runs):
            return [
                RunConfig(
                    algo,
                    n,
                    seed,
                    args.optimizer_steps,
                    args.minibatch_prompts * n,
                    args.group_size,
                    lr,
                    warm_seed=protocol.warm_seed(seed),
                    routing_replay=args.routing_replay,
                )
                for algo, n, lr, seed in runs
            ]

        def execute(cfgs):
            jobs = [_Job(c, spec, warms[c.warm_seed], cache_dir, out, args.threads, not args.train_base) for c in cfgs]
            with tqdm(
                total=sum(c.optimizer_steps for c in cfgs), unit="upd", disable=args.no_progress, file=sys.stderr
            ) as bar:
                return list(zip(cfgs, _execute(jobs, args.workers, bar)))

        if args.full:
            done = execute(configs(protocol.grid_runs(args.algos)))
        else:
            runs = [(a, n, lr, s) for n in args.reuse for lr in args.lr for s in args.seeds for a in args.algos]
            done = execute(configs(runs))
        records = [(_record(c, r["log"], out, argv, versions), c) for c, r in done]
        views: dict[str, list] = {}
        chosen = ""
        if args.full:
            late = late_scores(records, out)
            best = {a: protocol.best_lr(late, a) for a in args.algos}
            checks = grid_regime(done)
            in_regime = protocol.regime_rates(checks)
            common = protocol.common_lr(late, eligible=in_regime or None)
            chosen = (
                f"learning rates (late score at N = {protocol.GRID_REUSE}): best per method "
                + ", ".join(f"{a} {lr:g}" for a, lr in best.items())
                + "; in the regime for every method (grid runs pooled per method): "
                + (", ".join(f"{lr:g}" for lr in in_regime) or "none")
                + f"; common (chosen on {', '.join(protocol.BASELINES)}"
                + (" among the rates in the regime" if in_regime else ", no rate being in the regime")
                + f") {common:g}"
            )
            print(chosen, flush=True)
            done += execute(configs(protocol.verdict_runs(args.algos, common)))
            records = [(_record(c, r["log"], out, argv, versions), c) for c, r in done]
            pooled = grid_regime([(c, r) for c, r in done if c.lr == common])
            chosen += f"\n\nThe runs at the common rate, N = {protocol.GRID_REUSE}, pooled over their seeds:\n\n"
            chosen += "\n".join(f"- {a}: {pooled[(a, common)].line()}" for a in args.algos if (a, common) in pooled)
            for lr in args.lr:
                views[f"n{protocol.GRID_REUSE}_lr{lr:.0e}"] = [
                    r for r, c in records if c.lr == lr and c.reuse == protocol.GRID_REUSE
                ]
            views["best_lr"] = [r for r, c in records if c.reuse == protocol.GRID_REUSE and c.lr == best[c.algorithm]]
            views["common_lr"] = [r for r, c in records if c.lr == common]
        elif len(args.lr) > 1:
            for lr in args.lr:
                views[f"lr{lr:.0e}"] = [r for r, c in records if c.lr == lr]
        else:
            views["all"] = [r for r, _ in records]
    write_manifest([r for r, _ in records], out)
    wall = time.perf_counter() - start
    regime_lines = [f"- {r['name']}: {r['regime_line']}" for _, r in done]
    held = [r["name"] for _, r in done if r["holds"]]
    regime_lines += [
        "",
        f"In the regime: {len(held)} of {len(done)} runs" + (f" ({', '.join(held)})" if held else "") + ". The "
        'scores of a run outside it do not test the paper\'s claim (docs/mini.md, "Regime checks").',
    ]
    task_lines = [
        f"- {r['name']}: score of the first rollout batch {100 * r['first_score']:.1f} %, last quarter: correct "
        f"answers {r['last_quarter_correct_length']:.0f} tokens, correct/wrong length "
        f"{r['last_quarter_length_ratio']:.2f}"
        for _, r in done
    ]
    sections = [
        "# respo-verl mini",
        "",
        f"command: `respo-verl mini {shlex.join(argv)}`  ",
        f"machine: {host['cpu']} ({host['cpu_count']} CPUs), torch {host['torch']}, {args.threads} thread(s) per run, "
        f"{args.workers} worker(s); {len(done)} runs in {wall:.0f} s",
        "",
        "## Regime checks (stale half of every rollout batch)",
        "",
        *regime_lines,
        "",
        "## Task",
        "",
        *task_lines,
        "",
    ]
    if chosen:
        sections += [chosen, ""]
    for name, members in views.items():
        text, path = _report_view(name, members, out)
        sections += [f"## Report: {name} (`{path.relative_to(out)}`)", "", text, ""]
    summary = "\n".join(sections)
    (out / "results.md").write_text(summary)
    (out / "summary.json").write_text(json.dumps({"wall_s": wall, "machine": host, "runs": [r for _, r in done]}))
    print(summary)
    print(f"\ntotal {wall:.0f} s; summary {out / 'results.md'}; reports under {out / 'report'}")
    return 0
