"""``respo-verl`` console script: one subcommand per capability, each implemented in its own package.

Subcommands are imported lazily, so ``respo-verl --help`` stays fast and a subcommand's heavy imports (verl, torch,
transformers) happen only when it runs. A subcommand module exposes ``main(argv: list[str]) -> int``.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module with main(argv), one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("respo_verl.tools.demo", "a real verl run with ReSPO on this CPU (main_ppo +device=cpu), then its report"),
    "plan": ("respo_verl.tools.plan.cli", "check a cluster layout preset and estimate per-GPU memory"),
    "prepare-data": ("respo_verl.data.cli", "write DAPO-Math-17k or the evaluation sets in verl's parquet schema"),
    "sweep": ("respo_verl.tools.sweep.cli", "expand the ReSPO/VESPO/GRPO/GSPO x N x seed grid into verl runs"),
    "report": ("respo_verl.tools.report.cli", "late score, deltas to VESPO and plots from verl file-logger logs"),
}

# Commands that are no longer part of the package, with where they went.
MOVED = {
    "mini": "is research code outside the package: run `python -m experiments.mini` from a checkout (docs/mini.md)",
}


def _usage() -> str:
    lines = ["usage: respo-verl <command> [options]", "", "commands:"]
    width = max((len(name) for name in SUBCOMMANDS), default=0)
    lines += [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in sorted(SUBCOMMANDS.items())]
    lines.append("\n`respo-verl <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv:
        print(f"respo-verl: a command is required\n\n{_usage()}", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name in MOVED:
        print(f"respo-verl: {name!r} {MOVED[name]}", file=sys.stderr)
        return 2
    if name not in SUBCOMMANDS:
        print(f"respo-verl: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
