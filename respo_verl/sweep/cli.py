"""``respo-verl sweep``: expand the comparison grid into verl runs, write the manifest, and run them.

Example, the paper's grid on the Qwen3-30B-A3B H200 preset, printed for a scheduler::

    respo-verl sweep --model qwen3-30b-a3b --preset qwen3_30b_a3b_h200_1x8 --print -- \\
        actor_rollout_ref.model.path=/models/Qwen3-30B-A3B-Base data.train_files=... data.val_files=...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from respo_verl.sweep.grid import (
    ALGORITHMS,
    PAPER_MINI_BATCH,
    PAPER_OPTIMIZER_STEPS,
    PAPER_REUSE,
    PAPER_SEEDS,
    SweepSpec,
    expand,
)
from respo_verl.sweep.manifest import write_manifest
from respo_verl.sweep.runner import is_complete, run_locally, shell_line, submit_to_ray


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="respo-verl sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--algos", default=",".join(ALGORITHMS), help="comma-separated (default: all four)")
    p.add_argument("--reuse", type=_int_list, default=PAPER_REUSE, help="N values (default 8,16,32)")
    p.add_argument("--seeds", type=_int_list, default=PAPER_SEEDS, help="seeds (default 0,1,2)")
    p.add_argument("--model", default="model", help="model tag used in run names")
    p.add_argument("--preset", default=None, help="cluster preset, passed as +cluster=<preset>")
    p.add_argument("--routing", default=None, help="routing preset (off, r2, r3)")
    p.add_argument("--entry", choices=("respo", "verl"), default="respo", help="entry point of the runs")
    p.add_argument("--mini-batch", type=int, default=PAPER_MINI_BATCH, help="prompts per optimizer update")
    p.add_argument("--optimizer-steps", type=int, default=PAPER_OPTIMIZER_STEPS, help="updates per run")
    p.add_argument("--out", type=Path, default=Path("runs"), help="directory for logs and manifest.jsonl")
    p.add_argument("--project", default="respo_verl_sweep", help="trainer.project_name")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--print",
        "--dry-run",
        dest="print_only",
        action="store_true",
        help="print one shell line per run (for a scheduler) and write the manifest; run nothing",
    )
    mode.add_argument("--ray", metavar="ADDRESS", help="submit the runs as Ray jobs to this dashboard address")
    p.add_argument("--no-compose", action="store_true", help="skip composing each run (no config hash)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides shared by every run (after --)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = SweepSpec(
            algorithms=tuple(a.strip() for a in args.algos.split(",") if a.strip()),
            reuse=args.reuse,
            seeds=args.seeds,
            model=args.model,
            preset=args.preset,
            routing=args.routing,
            entry=args.entry,
            mini_batch=args.mini_batch,
            optimizer_steps=args.optimizer_steps,
            base_overrides=tuple(args.overrides),
            out_dir=args.out,
            project=args.project,
        )
        records = expand(spec, compose=not args.no_compose)
    except ValueError as exc:
        print(f"respo-verl sweep: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # Hydra's composition errors: say which run and why, without the deep traceback
        print(f"respo-verl sweep: a run does not compose: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    manifest = write_manifest(records, args.out)
    if args.print_only:
        for record in records:
            prefix = "# complete, skipped: " if is_complete(record, args.out) else ""
            print(prefix + shell_line(record))
        print(f"# {len(records)} runs; manifest: {manifest}", file=sys.stderr)
        return 0
    outcomes = submit_to_ray(records, args.out, args.ray) if args.ray else run_locally(records, args.out)
    for name, outcome in outcomes:
        print(f"{name}: {outcome}")
    print(f"manifest: {manifest}")
    return 1 if any(o.startswith("failed") for _, o in outcomes) else 0
