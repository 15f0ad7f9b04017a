"""Start-up check that every Ray node can import respo_verl and sees its registrations."""

from __future__ import annotations

import socket

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from respo_verl.verl.plugin import INSTALL_HINT

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


def check_ray_nodes(timeout_s: float = PREFLIGHT_TIMEOUT_S) -> list[dict]:
    """Run :func:`_probe` once on every alive Ray node; raise RuntimeError naming each node that fails.

    Returns:
        The probe result of every node.
    """
    probe = ray.remote(num_cpus=0)(_probe)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    results = ray.get(refs, timeout=timeout_s)
    failures = []
    for node, result in zip(nodes, results, strict=True):
        missing = [name for name, ok in result["registered"].items() if not ok]
        if result["error"] or missing:
            reason = result["error"] or f"not registered: {', '.join(missing)}"
            failures.append(f"node {node.get('NodeManagerAddress')} ({result['host']}): {reason}")
    if failures:
        raise RuntimeError("respo-verl preflight failed on " + "; ".join(failures) + f". Fix: {INSTALL_HINT}.")
    return results
