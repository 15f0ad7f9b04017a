"""``respo-verl`` console script: one subcommand per capability, each implemented in its own package.

Subcommands are imported lazily, so ``respo-verl --help`` stays fast and a subcommand's heavy imports (verl, torch,
transformers) happen only when it runs. A subcommand module exposes ``main(argv: list[str]) -> int``, which parses
the rest of the command line itself; ``prepare-data`` picks one such module more, by its dataset.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from respo_verl.data.cli import DATASETS

# name -> (module with main(argv), one-line help); a command that picks one module more by the word after it has
# (that word, a table of this kind) in place of its module
SUBCOMMANDS: dict[str, tuple] = {
    "demo": ("respo_verl.tools.demo", "a real verl run with ReSPO on this CPU (main_ppo +device=cpu), then its report"),
    "plan": ("respo_verl.tools.plan.cli", "check a cluster layout preset and estimate per-GPU memory"),
    "prepare-data": (("dataset", DATASETS), "write DAPO-Math-17k or the evaluation sets in verl's parquet schema"),
    "sweep": ("respo_verl.tools.sweep.cli", "expand the ReSPO/VESPO/GRPO/GSPO x N x seed grid into verl runs"),
    "report": ("respo_verl.tools.report.cli", "late score, deltas to VESPO and plots from verl file-logger logs"),
}

# Commands that are no longer part of the package, with where they went.
MOVED = {
    "mini": "is research code outside the package: run `python -m experiments.mini` from a checkout (docs/mini.md)",
}
EPILOG = "`respo-verl <command> --help` for a command's options."


def _run(prog: str, word: str, table: dict[str, tuple], argv: list[str], epilog: str | None = None) -> int:
    """Run what the first argument picks from ``table`` with the arguments after it (argparse subparsers, one per
    name, that leave the rest to the module's ``main``); 2 with one line and the usage for none or an unknown one."""
    parser = argparse.ArgumentParser(
        prog=prog, usage=f"{prog} <{word}> [options]", epilog=epilog, exit_on_error=False, allow_abbrev=False
    )
    choices = parser.add_subparsers(dest=word, title=f"{word}s", metavar=f"<{word}>")
    for name, (_, summary) in sorted(table.items()):
        choices.add_parser(name, help=summary, add_help=False)
    try:
        known, rest = parser.parse_known_args(argv)
    except SystemExit as done:  # --help, printed
        return int(done.code or 0)
    except argparse.ArgumentError:  # not one of the names
        known, rest = None, argv
    name = getattr(known, word, None)
    if name is None:
        got = f"unknown {word} {argv[0]!r}" if argv else f"a {word} is required"
        print(f"{prog}: {got}\n\n{parser.format_help()}", file=sys.stderr)
        return 2
    target = table[name][0]
    if isinstance(target, tuple):
        return _run(f"{prog} {name}", *target, rest)
    return int(importlib.import_module(target).main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in MOVED:
        print(f"respo-verl: {argv[0]!r} {MOVED[argv[0]]}", file=sys.stderr)
        return 2
    return _run("respo-verl", "command", SUBCOMMANDS, argv, EPILOG)


if __name__ == "__main__":
    sys.exit(main())
