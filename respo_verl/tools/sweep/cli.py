"""``respo-verl sweep``: expand the comparison grid into verl runs, write the manifest, and run them.

Example, the paper's grid on the Qwen3-30B-A3B H200 preset, printed for a scheduler::

    respo-verl sweep --model qwen3-30b-a3b --preset qwen3_30b_a3b_h200_1x8 --print -- \\
        actor_rollout_ref.model.path=/models/Qwen3-30B-A3B-Base data.train_files=... data.val_files=...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from respo_verl import algorithms
from respo_verl.protocol import PAPER_MINI_BATCH, PAPER_OPTIMIZER_STEPS, PAPER_REUSE, PAPER_SEEDS
from respo_verl.routing.mode import REPLAY_MODES
from respo_verl.tools.runs.manifest import write_manifest
from respo_verl.tools.runs.options import reuse_list, seed_list, split_overrides
from respo_verl.tools.sweep.grid import REPORT_LOGGER, VERL_LOGGERS, SweepSpec, expand_with_gpus
from respo_verl.tools.sweep.local import SweepBusy, folder_lock, run_locally, summary
from respo_verl.tools.sweep.rayjobs import run_on_ray
from respo_verl.tools.sweep.runner import (
    ClusterError,
    Status,
    SweepConflict,
    check_same_sweep,
    connect,
    is_complete,
    replace_sweep,
    shell_line,
    stale_files,
)
from respo_verl.tools.sweep.slurm import run_on_slurm

USAGE_ERROR = 2
INTERRUPTED = 130  # the shell's status of a command ended by Ctrl-C


def _algorithm_list(text: str) -> tuple[str, ...]:
    try:
        return algorithms.parse_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _logger_list(text: str) -> tuple[str, ...]:
    """The names of ``--logger`` (checked by SweepSpec, with a trainer.logger override's)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="respo-verl sweep",
        usage="respo-verl sweep [options] -- [hydra overrides shared by every run]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--algos", type=_algorithm_list, default=algorithms.ALGORITHMS,
                   help=f"comma-separated (default: {','.join(algorithms.ALGORITHMS)})")  # fmt: skip
    p.add_argument("--reuse", type=reuse_list, default=PAPER_REUSE,
                   help=f"N values, comma-separated (default {','.join(map(str, PAPER_REUSE))})")  # fmt: skip
    p.add_argument("--seeds", type=seed_list, default=PAPER_SEEDS,
                   help=f"seeds, comma-separated (default {','.join(map(str, PAPER_SEEDS))})")  # fmt: skip
    p.add_argument("--model", default="model", help="model tag used in run names")
    p.add_argument("--preset", default=None, help="cluster preset, passed as +cluster=<preset>")
    p.add_argument("--routing", choices=REPLAY_MODES, default=None, help="routing preset")
    p.add_argument("--entry", choices=("respo", "verl"), default="respo", help="entry point of the runs")
    p.add_argument("--mini-batch", type=int, default=PAPER_MINI_BATCH, help="prompts per optimizer update")
    p.add_argument("--optimizer-steps", type=int, default=PAPER_OPTIMIZER_STEPS, help="updates per run")
    p.add_argument("--out", type=Path, default=Path("runs"), help="directory for logs and manifest.jsonl")
    p.add_argument("--project", default="respo_verl_sweep", help="trainer.project_name")
    p.add_argument("--checkpoints", type=Path, default=None, metavar="DIR",
                   help="root of the runs' checkpoint folders, DIR/<run name> (default: OUT/checkpoints)")  # fmt: skip
    p.add_argument("--logger", type=_logger_list, default=None, metavar="NAMES",
                   help=f"verl's trackers of every run, comma-separated ({', '.join(VERL_LOGGERS)}); "
                   f"'{REPORT_LOGGER}' is added, the report reads it (default: a trainer.logger= override after --, "
                   "else console); not together with such an override")  # fmt: skip
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--print",
        "--dry-run",
        dest="print_only",
        action="store_true",
        help="print one shell line per run (for a scheduler) and write the manifest; run nothing",
    )
    mode.add_argument("--ray", metavar="ADDRESS", help="submit the runs as Ray jobs to this dashboard address")
    mode.add_argument("--slurm", action="store_true", help="submit the incomplete runs as one Slurm job array, "
                      "each task one run through scripts/launch/slurm/respo_verl.sbatch, and wait for it")  # fmt: skip
    p.add_argument("--max-running", type=int, default=None, metavar="K",
                   help="with --slurm or --ray: at most K runs at once (--slurm: the array's %%K; --ray: fewer than "
                   "the cluster's GPUs hold)")  # fmt: skip
    p.add_argument("--sbatch", default="", metavar="OPTIONS",
                   help='with --slurm: further sbatch options, one string ("--nodes=2 --time=24:00:00")')  # fmt: skip
    p.add_argument("--no-wait", action="store_true", help="with --ray: submit and return, without waiting")
    p.add_argument("--force", action="store_true", help="reuse an --out that holds another grid or other shared "
                   "settings: the files of the runs that differ move to OUT/replaced-<time>/")  # fmt: skip
    p.add_argument("--no-compose", action="store_true", help="skip composing and checking each run (no config hash; "
                   "the engine's seed key is then set only from a model_engine= override)")  # fmt: skip
    return p


def _error(message: str) -> int:
    print(f"respo-verl sweep: {message}", file=sys.stderr)
    return USAGE_ERROR


def main(argv: list[str]) -> int:
    options, overrides = split_overrides(list(argv))
    parser = _parser()
    try:
        args, extra = parser.parse_known_args(options)
    except SystemExit as exc:  # --help (0) or a malformed option (2), message already printed
        return int(exc.code or 0)
    if extra:
        return _error(
            f"unexpected argument(s) {' '.join(extra)!r}: lists are comma-separated (--reuse 8,16 --seeds 0,1,2) "
            "and Hydra overrides go after --"
        )
    try:
        spec = SweepSpec(
            algorithms=args.algos,
            reuse=args.reuse,
            seeds=args.seeds,
            model=args.model,
            preset=args.preset,
            routing=args.routing,
            entry=args.entry,
            mini_batch=args.mini_batch,
            optimizer_steps=args.optimizer_steps,
            base_overrides=tuple(overrides),
            out_dir=args.out,
            project=args.project,
            checkpoints=args.checkpoints,
            loggers=args.logger,
        )
        records, gpus = expand_with_gpus(spec, compose=not args.no_compose)
    except ValueError as exc:  # bad settings (SweepSpec), or a run that does not compose or pass check_job
        return _error(str(exc))
    try:
        if args.force and args.print_only:  # --print runs nothing and moves nothing: it says what a sweep would move
            stale = stale_files(records, args.out, args.checkpoints)
            if stale:
                for name, path in stale:
                    print(f"# --force would move {path} (run {name})", file=sys.stderr)
                return _error(
                    f"--force --print: {len(stale)} files of runs that differ are in --out {args.out}; --print moves "
                    "nothing and keeps the manifest: run with --force but without --print to move them"
                )
        elif args.force and args.out.is_dir():
            with folder_lock(args.out, print, wait=False):  # never while a sweep or its run uses the files
                moved = replace_sweep(records, args.out, args.checkpoints)
            if moved is not None:
                print(f"--force: the files of the runs that differ moved to {moved}", file=sys.stderr)
        elif not args.force:
            check_same_sweep(records, args.out)
    except (SweepConflict, SweepBusy) as exc:
        return _error(str(exc))
    except OSError as exc:
        return _error(f"--out {args.out}: cannot move the files of the runs that differ ({exc})")
    if args.sbatch and not args.slurm:
        return _error("--sbatch goes with --slurm")
    if args.max_running is not None and not (args.slurm or args.ray):
        return _error("--max-running goes with --slurm or --ray (a sweep run here runs one run at a time)")
    if args.max_running is not None and args.max_running < 1:
        return _error(f"--max-running must be at least 1 (got {args.max_running})")
    if args.no_wait and not args.ray:
        return _error("--no-wait goes with --ray (a sweep run here runs its runs one after another)")
    client = None
    if args.ray:
        unknown = [name for name, slots in gpus.items() if slots is None]
        if unknown:
            return _error(
                f"--ray --no-compose: the sweep cannot tell how many GPU slots run {unknown[0]} takes, so it cannot "
                "keep the cluster from overfilling; give trainer.nnodes=... trainer.n_gpus_per_node=... after --, "
                "or leave out --no-compose"
            )
        try:
            client = connect(args.ray)
        except ClusterError as exc:
            return _error(str(exc))
    try:
        manifest = write_manifest(records, args.out)
    except OSError as exc:
        return _error(f"--out {args.out}: cannot write the manifest there ({exc.strerror or exc})")
    if args.print_only:
        for record in records:
            prefix = "# complete, skipped: " if is_complete(record, args.out) else ""
            print(prefix + shell_line(record))
        print(f"# {len(records)} runs; manifest: {manifest}", file=sys.stderr)
        return 0
    if args.ray:
        try:
            outcomes = run_on_ray(records, gpus, args.out, client, args.max_running, wait=not args.no_wait)
        except ClusterError as exc:  # e.g. a head whose job agent never came up
            return _error(str(exc))
        except KeyboardInterrupt:
            print("respo-verl sweep: stopped waiting; the jobs go on (the same command waits for them again and "
                  "submits the runs still waiting)", file=sys.stderr)  # fmt: skip
            return INTERRUPTED
        print(f"manifest: {manifest}")
        if not args.no_wait:
            print(summary(outcomes, len(records)), flush=True)
        return 1 if any(o.status is Status.FAILED for o in outcomes) else 0
    if args.slurm:
        try:
            outcomes = run_on_slurm(records, args.out, args.max_running, args.sbatch)
        except ClusterError as exc:
            return _error(str(exc))
        except KeyboardInterrupt:
            return INTERRUPTED
        print(f"manifest: {manifest}")
        print(summary(outcomes, len(records)), flush=True)
        return 1 if any(o.status is Status.FAILED for o in outcomes) else 0
    try:
        outcomes = run_locally(records, args.out)
    except SweepBusy as exc:
        return _error(str(exc))
    print(f"manifest: {manifest}")
    print(summary(outcomes, len(records)), flush=True)
    interrupted = [o for o in outcomes if o.status is Status.INTERRUPTED]
    if interrupted:
        return INTERRUPTED
    return 1 if any(o.status is Status.FAILED for o in outcomes) else 0
