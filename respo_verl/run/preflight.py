"""Start-up check that every Ray node can import respo_verl, sees its registrations, and has what the job needs.

What the job needs (vLLM, megatron-core, Transformer Engine, DeepEP, CUDA GPUs, ...) is derived from the composed
config by :func:`respo_verl.run.requirements.job_requirements`; the probe imports each piece on every node
(:func:`respo_verl.run.requirements.check_missing`).
"""

from __future__ import annotations

import importlib
import re
import socket
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from respo_verl.core.advantages import ESTIMATOR
from respo_verl.core.losses import KERNELS
from respo_verl.entry_points import INSTALL_HINT, PLUGIN_MODULE
from respo_verl.routing.engine import REGISTRATION as ROUTE_DRIFT_ENGINES
from respo_verl.run.nodes import SharedFolders, unseen
from respo_verl.run.requirements import Requirement
from respo_verl.run.trainer import REGISTRATION as TRAINER

# Long enough for a cold worker process to import torch and verl on a busy node.
PREFLIGHT_TIMEOUT_S = 300.0
# The probe asks Ray for no GPU, and Ray may then set CUDA_VISIBLE_DEVICES="" in its task (by the default of
# RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO on the Ray releases verl allows): these keep the node's own, which the GPU
# workers' ids index.
PROBE_RUNTIME_ENV = {
    "env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
}


def registered() -> dict[str, bool]:
    """Which of the plugin's registrations are visible in this process: every kernel loss, the estimator, the
    route-drift engines and the respo-verl trainer."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

    status = {f"policy_loss/{name}": name in POLICY_LOSS_REGISTRY for name in KERNELS}
    status[f"adv_estimator/{ESTIMATOR}"] = ESTIMATOR in ADV_ESTIMATOR_REGISTRY
    status["engine/route_drift"] = ROUTE_DRIFT_ENGINES.applied
    status["trainer/respo_sync"] = TRAINER.applied
    return status


def _probe(requirements: tuple[Requirement, ...] = (), folders: SharedFolders | None = None) -> dict:
    """Runs on one node: which of our registrations are visible there, which of ``requirements`` are missing, and
    what of ``folders`` it does not see."""
    host = socket.gethostname()
    if folders is not None and (problems := unseen(folders)):
        return {"host": host, "unseen": problems}
    try:
        from respo_verl.run.requirements import check_missing

        missing = check_missing(list(requirements))
    except Exception as exc:  # reported with the rest; the registration check below still runs
        missing = [f"the requirement check could not run ({type(exc).__name__}: {exc})".splitlines()[0]]
    try:
        import verl  # noqa: F401  (loads the verl.plugins entry points, as in every verl process)

        # By name, as verl loads VERL_USE_EXTERNAL_MODULES: the probe also passes with verl's entry points turned off.
        importlib.import_module(PLUGIN_MODULE)
        return {"host": host, "registered": registered(), "error": None, "missing": missing}
    except Exception as exc:  # reported back to the driver, which raises with the node named
        return {"host": host, "registered": {}, "error": f"{type(exc).__name__}: {exc}", "missing": missing}


def _innermost_error(exc: BaseException) -> str:
    """The last ``...Error: message`` line of a Ray error (its text nests the remote traceback), colours removed."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(exc).splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return errors[-1] if errors else type(exc).__name__


def check_ray_nodes(
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
    requirements: list[Requirement] | tuple[Requirement, ...] = (),
    folders: SharedFolders | None = None,
) -> list[dict]:
    """Run :func:`_probe` once on every alive Ray node and return its results; raise RuntimeError naming each node
    where it fails, does not answer within ``timeout_s`` or finds something missing (one line per missing piece).
    The driver's marker of ``folders`` (:func:`respo_verl.run.nodes.shared_folders`) is removed afterwards."""
    probe = ray.remote(num_cpus=0)(_probe)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    shipped = tuple(requirements)
    refs = [
        probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False),
            runtime_env=PROBE_RUNTIME_ENV,
        ).remote(shipped, folders)
        for n in nodes
    ]
    try:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    finally:
        if folders is not None:
            Path(folders.marker).unlink(missing_ok=True)
    results, failures, missing_lines, lacking, blind = [], [], [], set(), []
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
        if result.get("unseen"):
            blind.append(f"{where} ({result['host']}) " + "; ".join(result["unseen"]))
            continue
        results.append(result)
        missing = [name for name, ok in result["registered"].items() if not ok]
        if result["error"] or missing:
            reason = result["error"] or f"not registered: {', '.join(missing)}"
            failures.append(f"{where} ({result['host']}): {reason}")
        missing_lines += [f"{where} ({result['host']}): {line}" for line in result.get("missing", ())]
        lacking |= {node["NodeID"]} if result.get("missing") else set()
    if blind:
        raise RuntimeError(
            "respo-verl preflight failed: "
            + "; ".join(blind)
            + ": every node must see the checkpoint root and the data at the driver's paths (shared storage)"
        )
    if failures:
        message = "respo-verl preflight failed on " + "; ".join(failures) + f". Fix: {INSTALL_HINT}."
        raise RuntimeError("\n".join([message, *missing_lines]))
    if missing_lines:
        header = (
            f"respo-verl preflight failed on {len(lacking)} node(s): the job needs what they lack "
            "(install it there, or change the key named):"
        )
        raise RuntimeError("\n".join([header, *missing_lines]))
    return results
