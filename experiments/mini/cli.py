"""``python -m experiments.mini``: the paper's experiment in miniature on CPU (tiny Qwen3, rollout reuse N, long
answers).

Quick mode (default): the four algorithms at N = 32, one seed, 192 updates, at the protocol's quick learning rate
(a smoke run with the regime checks, not a comparison). ``--full``: the learning-rate grid at N = 32 for every
algorithm with one RL seed per warm start; then, at the common learning rate (chosen on the baselines only, among
the rates in the paper's regime), ReSPO and VESPO with 8 seeds (2 warm starts × 4 RL seeds) at N = 32 and 2 seeds at
N ∈ {8, 16}
(``experiments.mini.protocol``). Every run prints and logs the regime checks (``experiments.mini.regime``); the scores
are ``respo-verl report``'s (late = last 128 updates). ``--grid NAME`` runs a named grid of
``experiments.mini.protocol.GRIDS`` at the verdict's common rate and seeds, with paired intervals, skipping runs
already complete in --out: ``ablate`` (also ``--ablate``), the branch ablation; ``trend``, N ∈ {8, 16, 32}; ``horizon``,
the paper's 1024 updates with held-out problems scored at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from experiments.mini import experiment, protocol, summary, tasks
from experiments.mini.train import lr_label
from respo_verl import algorithms
from respo_verl.tools.runs.machine import describe as describe_machine
from respo_verl.tools.runs.options import reuse_list, seed_list

PROG = "python -m experiments.mini"
USAGE_ERROR = 2


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
        prog=PROG, description=" ".join(__doc__.split("\n\n")[:2]).replace("\n", " ").replace("``", "")
    )
    parser.add_argument("--full", action="store_true", help="the protocol's full grid (learning rates, N, 8 seeds)")
    parser.add_argument(
        "--grid",
        choices=sorted(protocol.GRIDS),
        default=None,
        help="a named grid at its rate, resumable (--seeds reduces it): "
        + "; ".join(f"{g.name}: {g.about}, lr {g.lr:g}" for g in protocol.GRIDS.values()),
    )
    parser.add_argument("--ablate", action="store_true", help="the same as --grid ablate")
    parser.add_argument(
        "--resume", action="store_true", help="skip runs whose log and result are complete in --out (--ablate: always)"
    )
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
    parser.add_argument(
        "--task",
        choices=tasks.NAMES,
        default=tasks.DEFAULT,
        help=f"the task (default {tasks.DEFAULT}; fork: know when to stop, both tails of W)",
    )
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
    if args.ablate:
        if args.grid not in (None, "ablate"):
            raise UsageError(f"--ablate is --grid ablate: it takes no --grid {args.grid}")
        args.grid = "ablate"
    if args.grid is not None:
        flag = "--ablate" if args.ablate else f"--grid {args.grid}"
        if args.full or any(v is not None for v in (args.algos, args.reuse, args.lr, args.optimizer_steps)):
            raise UsageError(
                f"{flag} runs the {args.grid} grid: it takes no --full, --algos, --reuse, --lr or --optimizer-steps "
                "(--seeds reduces it)"
            )
        if args.moe:
            raise UsageError(f"{flag} runs the dense model of the verdict: it takes no --moe")
        grid = protocol.GRIDS[args.grid]
        args.runs = grid.runs(tuple(args.seeds) if args.seeds else None)
        if not args.runs:
            raise UsageError(f"--seeds {','.join(map(str, args.seeds))}: the {args.grid} grid has no run with them")
        args.algos = sorted({a for a, _, _, _ in args.runs}, key=algorithms.order)
        args.reuse, args.lr = sorted({n for _, n, _, _ in args.runs}), [grid.lr]
        args.seeds = sorted({s for _, _, _, s in args.runs})
        args.optimizer_steps = grid.optimizer_steps
        args.held_out = grid.held_out
        args.resume = True
    else:
        args.held_out = False
    ablations = [a for a in args.algos or () if a in algorithms.ABLATIONS]
    if ablations and args.grid is None:
        raise UsageError(f"{', '.join(ablations)}: the ablation presets run through --grid ablate (--ablate)")
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
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exc:  # argparse: --help (0) or a malformed option (2), message already printed
        return int(exc.code or 0)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"{PROG}: error: --out {args.out}: cannot create it ({exc.strerror or exc})", file=sys.stderr)
        return USAGE_ERROR
    return run(args, argv)


class _Session:
    """One invocation's shared state: options, output folder, machine, base models, progress bars."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        import importlib.metadata

        from experiments.mini import model as model_lib

        self.args, self.argv = args, argv
        self.out = args.out.resolve()
        self.host = describe_machine(args.threads)
        self.versions = {"respo-verl": importlib.metadata.version("respo-verl"), **self.host}
        self.spec = model_lib.ModelSpec(moe=args.moe)
        self.cache_dir = args.cache_dir or model_lib.DEFAULT_CACHE_DIR
        steps = tasks.get(args.task).warm_start_steps if args.warm_start_steps is None else args.warm_start_steps
        warm_steps = {} if steps is None else {"steps": steps}
        seeds = sorted({protocol.warm_seed(s) for s in args.seeds})
        self.warms = {w: model_lib.WarmStart(seed=w, **warm_steps) for w in seeds}

    def _bar(self, total: int, unit: str):
        from tqdm import tqdm

        return tqdm(total=total, unit=unit, disable=self.args.no_progress, file=sys.stderr)

    def warm_start(self) -> None:
        from experiments.mini import model as model_lib

        for w, warm in self.warms.items():
            with self._bar(warm.steps, "step") as bar:
                bar.set_description(f"warm start {w}")
                _, origin = model_lib.warm_start(
                    self.spec,
                    warm,
                    self.cache_dir,
                    on_step=lambda _: bar.update(1),
                    shipped=not self.args.train_base,
                    task_name=self.args.task,
                )
            print(f"base model {w} ({'Qwen3-MoE' if self.args.moe else 'Qwen3'}): {origin}", flush=True)

    def configs(self, runs):
        """RunConfigs of (algorithm, N, lr, seed) tuples."""
        from experiments.mini.train import RunConfig

        a = self.args
        return [
            RunConfig(
                algo,
                n,
                seed,
                a.optimizer_steps,
                a.minibatch_prompts * n,
                a.group_size,
                lr,
                warm_seed=protocol.warm_seed(seed),
                routing_replay=a.routing_replay,
                held_out=a.held_out,
                task=a.task,
            )
            for algo, n, lr, seed in runs
        ]

    def jobs(self, cfgs) -> list:
        a = self.args
        return [
            experiment.Job(c, self.spec, self.warms[c.warm_seed], self.cache_dir, self.out, a.threads, not a.train_base)
            for c in cfgs
        ]

    def execute(self, cfgs) -> list:
        """Run the configurations; (RunConfig, JobResult) pairs in their order."""
        with self._bar(sum(c.optimizer_steps for c in cfgs), "upd") as bar:
            return list(zip(cfgs, experiment.execute(self.jobs(cfgs), self.args.workers, bar, self.args.resume)))

    def records(self, done) -> list:
        """(RunRecord, RunConfig) pairs of finished runs."""
        return [(experiment.record(c, r.log, self.out, self.argv, self.versions), c) for c, r in done]


def _run_full(session: _Session) -> tuple[list, dict[str, list], str]:
    """The protocol: the grid at N = 32, the choice of rates, then the verdict's seeds at the common rate."""
    args = session.args
    done = session.execute(session.configs(protocol.grid_runs(args.algos)))
    rates = summary.choose_rates(args.algos, session.records(done), done, session.out)
    print(rates.line(), flush=True)
    done += session.execute(session.configs(protocol.verdict_runs(args.algos, rates.common)))
    records = session.records(done)
    pooled = summary.grid_regime([(c, r) for c, r in done if c.lr == rates.common])
    chosen = rates.line() + f"\n\nThe runs at the common rate, N = {protocol.GRID_REUSE}, pooled over their seeds:\n\n"
    chosen += "\n".join(f"- {a}: {pooled[(a, rates.common)].line()}" for a in args.algos if (a, rates.common) in pooled)
    views = {
        f"n{protocol.GRID_REUSE}_lr{lr_label(lr)}": [
            r for r, c in records if c.lr == lr and c.reuse == protocol.GRID_REUSE
        ]
        for lr in args.lr
    }
    views["best_lr"] = [r for r, c in records if c.reuse == protocol.GRID_REUSE and c.lr == rates.best[c.algorithm]]
    views["common_lr"] = [r for r, c in records if c.lr == rates.common]
    return done, views, chosen


def _run_listed(session: _Session) -> tuple[list, dict[str, list], str]:
    """Quick mode or the options given: every algorithm × N × lr × seed."""
    args = session.args
    runs = [(a, n, lr, s) for n in args.reuse for lr in args.lr for s in args.seeds for a in args.algos]
    done = session.execute(session.configs(runs))
    records = session.records(done)
    if len(args.lr) > 1:
        views = {f"lr{lr_label(lr)}": [r for r, c in records if c.lr == lr] for lr in args.lr}
    else:
        views = {"all": [r for r, _ in records]}
    return done, views, ""


def _run_grid(session: _Session) -> tuple[list, list[str]]:
    """A named grid (``protocol.GRIDS``): its runs, skipping those complete in --out, then its tables."""
    args = session.args
    grid = protocol.GRIDS[args.grid]
    cfgs = session.configs(args.runs)
    todo = sum(experiment.completed(job) is None for job in session.jobs(cfgs))
    per_run = protocol.RUN_SECONDS_ESTIMATE * grid.optimizer_steps / protocol.FULL_OPTIMIZER_STEPS
    print(
        f"{grid.name}: {len(cfgs)} runs ({todo} to do, {len(cfgs) - todo} complete) on {args.workers} worker(s); "
        f"estimated {grid.estimate_s(todo, args.workers) / 60:.0f} min ({per_run:.0f} s per run per worker)",
        flush=True,
    )
    done = session.execute(cfgs)
    scores = summary.scores_by_seed(done)
    if grid.name == "ablate":
        table = summary.ablation_markdown({a: v["late"] for (a, _), v in scores.items()}, grid.lr, protocol.GRID_REUSE)
    else:
        table = summary.grid_markdown(grid, scores)
    return done, table


def run(args: argparse.Namespace, argv: list[str]) -> int:
    experiment.quiet()
    import torch
    from tqdm.contrib.logging import logging_redirect_tqdm

    from respo_verl.tools.runs.manifest import write_manifest

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    session = _Session(args, argv)
    out = session.out
    print(f"{PROG}: writing to {out}", flush=True)
    (out / "machine.json").write_text(json.dumps(session.host, indent=2) + "\n")
    start = time.perf_counter()
    with logging_redirect_tqdm():
        session.warm_start()
        if args.grid is not None:
            done, table = _run_grid(session)
        else:
            done, views, chosen = (_run_full if args.full else _run_listed)(session)
    if args.grid is not None:
        return _finish_grid(session, done, table, time.perf_counter() - start)
    write_manifest([r for r, _ in session.records(done)], out)
    wall = time.perf_counter() - start
    sections = summary.results_markdown(argv, session.host, args.threads, args.workers, done, wall)
    if chosen:
        sections += [chosen, ""]
    for name, members in views.items():
        text, path = summary.report_view(name, members, out)
        sections += [f"## Report: {name} (`{path.relative_to(out)}`)", "", text, ""]
    _write_results(session, sections, done, wall)
    print(f"\ntotal {wall:.0f} s; summary {out / 'results.md'}; reports under {out / 'report'}")
    return 0


def _write_results(session: _Session, sections: list[str], done: list, wall: float) -> None:
    """``results.md`` (printed too) and ``summary.json`` of an invocation."""
    results = "\n".join(sections)
    (session.out / "results.md").write_text(results)
    runs = [r.as_dict() for _, r in done]
    (session.out / "summary.json").write_text(json.dumps({"wall_s": wall, "machine": session.host, "runs": runs}))
    print(results)


def _finish_grid(session: _Session, done: list, table: list[str], wall: float) -> int:
    """The manifest, results.md, summary.json and ``respo-verl report`` of a named grid (``report/<grid>/``: its
    scores, starved mass and the gap plot, the ablation presets included)."""
    from respo_verl.tools.runs.manifest import write_manifest

    out, args = session.out, session.args
    records = [r for r, _ in session.records(done)]
    write_manifest(records, out)
    sections = summary.results_markdown(session.argv, session.host, args.threads, args.workers, done, wall)
    pooled = summary.pooled_regime_lines(done)
    if pooled:
        heading = f"## Regime checks of each method at N = {protocol.GRID_REUSE}, pooled over its seeds"
        sections += [heading, "", *pooled, ""]
    sections += [f"## {protocol.GRIDS[args.grid].about[0].upper()}{protocol.GRIDS[args.grid].about[1:]}", "", *table]
    text, path = summary.report_view(args.grid, records, out)
    sections += ["", f"## Report: {args.grid} (`{path.relative_to(out)}`)", "", text, ""]
    _write_results(session, sections, done, wall)
    print(f"\nmeasured wall time {wall:.0f} s ({wall / 60:.1f} min); summary {out / 'results.md'}")
    return 0
