"""Start-up check that every Ray node can import respo_verl and sees its registrations."""

from __future__ import annotations

import re
import socket

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from respo_verl.entry_points import INSTALL_HINT

# Long enough for a cold worker process to import torch and verl on a busy node.
PREFLIGHT_TIMEOUT_S = 300.0


def _probe() -> dict:
    """Runs on one node: which of our registrations are visible there."""
    host = socket.gethostname()
    try:
        import verl  # noqa: F401  (loads the verl.plugins entry points, as in every verl process)

        from respo_verl.verl.plugin import registered

        return {"host": host, "registered": registered(), "error": None}
    except Exception as exc:  # reported back to the driver, which raises with the node named
        return {"host": host, "registered": {}, "error": f"{type(exc).__name__}: {exc}"}


def _innermost_error(exc: BaseException) -> str:
    """The last ``...Error: message`` line of a Ray error (its text nests the remote traceback), colours removed."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(exc).splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return errors[-1] if errors else type(exc).__name__


def check_ray_nodes(timeout_s: float = PREFLIGHT_TIMEOUT_S) -> list[dict]:
    """Run :func:`_probe` once on every alive Ray node; raise RuntimeError naming each node that fails.

    A node fails when the probe reports missing registrations, when the probe itself cannot run there (a node
    without respo_verl cannot even load this module, and Ray raises on ``get``), or when it does not answer within
    ``timeout_s``.

    Returns:
        The probe result of every node.
    """
    probe = ray.remote(num_cpus=0)(_probe)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    results, failures = [], []
    for node, ref in zip(nodes, refs, strict=True):
        where = f"node {node.get('NodeManagerAddress')}"
        try:
            result = ray.get(ref, timeout=0)
        except ray.exceptions.GetTimeoutError:
            failures.append(f"{where}: no answer within {timeout_s:.0f} s")
            continue
        except ray.exceptions.RayError as exc:
            failures.append(f"{where}: the probe could not run ({_innermost_error(exc)})")
            continue
        results.append(result)
        missing = [name for name, ok in result["registered"].items() if not ok]
        if result["error"] or missing:
            reason = result["error"] or f"not registered: {', '.join(missing)}"
            failures.append(f"{where} ({result['host']}): {reason}")
    if failures:
        raise RuntimeError("respo-verl preflight failed on " + "; ".join(failures) + f". Fix: {INSTALL_HINT}.")
    return results
