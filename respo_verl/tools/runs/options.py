"""Command-line list syntax shared by ``respo-verl sweep`` and the miniature: comma-separated values.

``--reuse 8,16,32 --seeds 0,1,2``. Anything else (spaces between values, empty items, repeats, non-integers) is
refused with one line that says what was expected.
"""

from __future__ import annotations

import argparse


def int_list(text: str, minimum: int = 0) -> tuple[int, ...]:
    """``"8,16,32"`` → ``(8, 16, 32)``.

    Raises:
        ValueError: for an empty item, a non-integer, a value below ``minimum`` or a repeated value.
    """
    items = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ValueError(f"expected a comma-separated list of integers such as 8,16,32, got {text!r}")
    try:
        values = tuple(int(item) for item in items)
    except ValueError:
        raise ValueError(f"expected a comma-separated list of integers such as 8,16,32, got {text!r}") from None
    low = [v for v in values if v < minimum]
    if low:
        raise ValueError(f"values in {text!r} must be >= {minimum}, got {low}")
    if len(set(values)) != len(values):
        raise ValueError(f"list {text!r} repeats a value")
    return values


def reuse_list(text: str) -> tuple[int, ...]:
    """argparse type for N values (each >= 1)."""
    try:
        return int_list(text, minimum=1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seed_list(text: str) -> tuple[int, ...]:
    """argparse type for seeds (each >= 0)."""
    try:
        return int_list(text, minimum=0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Options before ``--`` and Hydra overrides after it (``--`` absent: no overrides)."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return list(argv), []
