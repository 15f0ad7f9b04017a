"""The algorithms a comparison runs: preset names, their order in tables and plots, display names and colours.

One list for the whole package. The names are the ``algorithm=<name>`` presets (``configs/algorithm``);
the order is the paper's table order (the method, the baseline it is compared with, then the other baselines).
:data:`ABLATIONS` are the branch-ablation presets (docs/method.md, "Branch ablation"): :func:`get` knows them, but
they are not among the default :data:`ALGORITHMS` of sweeps and reports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    """One algorithm preset.

    Attributes:
        name: the preset name (``algorithm=<name>``), also the tag in run names.
        display: how tables and plot legends name it.
        color: its matplotlib colour, the same in every plot.
    """

    name: str
    display: str
    color: str


_ALGORITHMS = (
    Algorithm("respo", "ReSPO", "tab:red"),
    Algorithm("vespo", "VESPO", "tab:orange"),
    Algorithm("grpo", "GRPO", "tab:blue"),
    Algorithm("gspo", "GSPO", "tab:green"),
)
_ABLATIONS = (
    Algorithm("respo_pos", "ReSPO+ / VESPO−", "tab:purple"),
    Algorithm("respo_neg", "VESPO+ / ReSPO−", "tab:brown"),
    Algorithm("phi_one", "φ ≡ 1", "tab:gray"),
    Algorithm("grpo_noclip", "GRPO no clip", "tab:cyan"),
)
BY_NAME = {a.name: a for a in (*_ALGORITHMS, *_ABLATIONS)}
ALGORITHMS: tuple[str, ...] = tuple(a.name for a in _ALGORITHMS)
ABLATIONS: tuple[str, ...] = tuple(a.name for a in _ABLATIONS)
# Every preset a run can name: the default algorithms, then the ablations.
NAMES: tuple[str, ...] = (*ALGORITHMS, *ABLATIONS)
# Differences in the comparison report are taken to this algorithm's late score at the same N.
BASELINE = "vespo"


def get(name: str) -> Algorithm:
    """The algorithm called ``name``; ValueError naming the choices for any other name."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(NAMES)}") from None


def display_name(name: str) -> str:
    return get(name).display


def order(name: str) -> int:
    """Sort key: position in :data:`ALGORITHMS`, then in :data:`ABLATIONS`."""
    return NAMES.index(get(name).name)


def parse_list(text: str) -> tuple[str, ...]:
    """``"respo,vespo"`` → ``("respo", "vespo")``; ValueError for an unknown, repeated or missing name."""
    names = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not n for n in names):
        raise ValueError(f"expected a comma-separated list of algorithms from {', '.join(NAMES)}, got {text!r}")
    for name in names:
        get(name)
    if len(set(names)) != len(names):
        raise ValueError(f"algorithm list {text!r} repeats a name")
    return tuple(names)
