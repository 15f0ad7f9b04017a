"""Our registrations reach every verl process: fresh interpreters, Ray workers, and the loud start-up checks.

Registration routes (see ``respo_verl.verl.plugin``): the ``verl.plugins`` entry point (``import verl``), importing
the plugin through the ``ReSPOPolicyLossConfig`` config class, and the Ray preflight that probes every node.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from respo_verl.core.advantages import ESTIMATOR
from respo_verl.core.losses import KERNELS
from respo_verl.entry_points import INSTALL_HINT
from respo_verl.verl.config import ReSPOPolicyLossConfig

# Every verl process imports torch and verl first (about 5 s on an idle 2-core box); this bounds a hang, not a run.
SUBPROCESS_TIMEOUT_S = 180
RAY_GET_TIMEOUT_S = 120
# Below this Ray refuses to start; the tests move no data through the object store.
RAY_OBJECT_STORE_BYTES = 80 * 1024**2
RESULT_MARKER = "RESULT_JSON:"
ALL_REGISTERED = {
    **{f"policy_loss/{name}": True for name in KERNELS},
    f"adv_estimator/{ESTIMATOR}": True,
    "engine/route_drift": True,
    "trainer/respo_sync": True,
}

REGISTRY_PROBE = """
import json, sys
{before}
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

def status():
    return {{
        "respo": "respo" in POLICY_LOSS_REGISTRY,
        "vespo": "vespo" in POLICY_LOSS_REGISTRY,
        "adv_respo": "respo" in ADV_ESTIMATOR_REGISTRY,
    }}

result = {{"after_import_verl": status(), "modules": sorted(m for m in sys.modules if m.startswith("respo_verl"))}}
{after}
print("@MARKER@" + json.dumps(result))
""".replace("@MARKER@", RESULT_MARKER)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    env.pop("PYTHONPATH", None)
    env.update(HF_HUB_OFFLINE="1", TORCH_COMPILE_DISABLE="1", **extra)
    return env


def _run_python(code: str, env: dict[str, str], cwd: Path, args: tuple[str, ...] = ()) -> dict:
    """Run ``code`` in a fresh interpreter (cwd outside the repository) and return the JSON it reports."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    assert proc.returncode == 0 and len(lines) == 1, (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return json.loads(lines[0][len(RESULT_MARKER) :])


def test_entry_point_names_the_plugin_module():
    eps = [ep for ep in entry_points(group="verl.plugins") if ep.value == "respo_verl.verl.plugin"]
    assert len(eps) == 1, list(entry_points(group="verl.plugins"))


@pytest.mark.slow
def test_import_verl_alone_registers_everything_in_a_fresh_process(tmp_path):
    result = _run_python(REGISTRY_PROBE.format(before="import verl", after=""), _clean_env(), tmp_path)
    assert result["after_import_verl"] == {"respo": True, "vespo": True, "adv_respo": True}
    assert "respo_verl.verl.plugin" in result["modules"]


@pytest.mark.slow
def test_without_entry_points_building_the_config_class_registers(tmp_path):
    """The control for the test above: with entry points off, ``import verl`` registers nothing of ours."""
    after = """
import respo_verl.verl.config as config_module
result["after_import_config_module"] = status()
config_module.ReSPOPolicyLossConfig(loss_mode="respo")
result["after_building_config"] = status()
"""
    result = _run_python(
        REGISTRY_PROBE.format(before="import verl", after=after),
        _clean_env(VERL_USE_EXTERNAL_PLUGINS="none"),
        tmp_path,
    )
    nothing = {"respo": False, "vespo": False, "adv_respo": False}
    assert result["after_import_verl"] == nothing
    assert result["modules"] == []
    # The plugin is imported when the config is built (in __post_init__), not when its module is imported.
    assert result["after_import_config_module"] == nothing
    assert result["after_building_config"] == {"respo": True, "vespo": True, "adv_respo": True}


def test_unknown_loss_mode_fails_when_the_config_is_built():
    with pytest.raises(ValueError) as excinfo:
        ReSPOPolicyLossConfig(loss_mode="no_such_loss")
    message = str(excinfo.value)
    assert "'no_such_loss'" in message
    assert INSTALL_HINT in message
    assert "respo" in message and "vanilla" in message  # the registered names are listed


# --------------------------------------------------------------------------------------------------------------------
# Ray: one local cluster for the module; a second driver joins it to run jobs with their own runtime_env.


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    from ray import cloudpickle

    # Unix socket paths under the temp dir must stay short (~107 bytes), so not pytest's tmp_path.
    temp_dir = tempfile.mkdtemp(prefix="rv", dir="/tmp")
    assert not ray.is_initialized()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=temp_dir,
        object_store_memory=RAY_OBJECT_STORE_BYTES,
        log_to_driver=False,
    )
    # Workers cannot import this test module (pytest put its directory on sys.path), so its functions travel by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield ray
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _worker_registry_status() -> dict:
    """Runs in a Ray worker: what ``import verl`` alone registers there (shipped by value, see the fixture)."""
    preloaded = sorted(m for m in sys.modules if m.startswith("respo_verl"))
    import verl  # noqa: F401  (loads the verl.plugins entry points, as in every verl process)
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

    return {
        "preloaded": preloaded,
        "respo": "respo" in POLICY_LOSS_REGISTRY,
        "vespo": "vespo" in POLICY_LOSS_REGISTRY,
        "adv_respo": "respo" in ADV_ESTIMATOR_REGISTRY,
        "plugins_env": os.environ.get("VERL_USE_EXTERNAL_PLUGINS"),
    }


def _fresh_worker_status(ray, plugins_env: str | None) -> dict:
    # A runtime_env of its own gives the task a worker process that no other test's task has run in (Ray keys its
    # worker pools by runtime_env), and max_calls=1 retires it afterwards.
    env_vars = {"RESPO_VERL_TEST_WORKER": f"plugins={plugins_env}"}
    if plugins_env is not None:
        env_vars["VERL_USE_EXTERNAL_PLUGINS"] = plugins_env
    status = ray.remote(num_cpus=0, max_calls=1)(_worker_registry_status)
    return ray.get(status.options(runtime_env={"env_vars": env_vars}).remote(), timeout=RAY_GET_TIMEOUT_S)


@pytest.mark.slow
def test_import_verl_registers_in_a_ray_worker(ray_cluster):
    result = _fresh_worker_status(ray_cluster, None)
    assert result == {"preloaded": [], "respo": True, "vespo": True, "adv_respo": True, "plugins_env": None}


@pytest.mark.slow
def test_entry_points_off_in_a_ray_worker_register_nothing(ray_cluster):
    """The env var reaches the worker and switches the entry point off: the control for the test above."""
    result = _fresh_worker_status(ray_cluster, "none")
    assert result == {"preloaded": [], "respo": False, "vespo": False, "adv_respo": False, "plugins_env": "none"}


@pytest.mark.slow
def test_preflight_passes_on_a_healthy_cluster(ray_cluster):
    from respo_verl.run.preflight import check_ray_nodes

    results = check_ray_nodes(timeout_s=RAY_GET_TIMEOUT_S)
    assert len(results) == 1
    (result,) = results
    assert result["error"] is None
    assert result["registered"] == ALL_REGISTERED


# A second driver joining the module's cluster as its own job, so that the job-level runtime_env reaches the preflight's
# probe tasks (check_ray_nodes takes no runtime_env of its own). It runs from a directory outside the repository:
# Ray puts the driver's working directory on every worker's sys.path.
PREFLIGHT_DRIVER = """
import json, sys
import ray
from respo_verl.run.preflight import check_ray_nodes

ray.init(address=sys.argv[1], runtime_env={"env_vars": json.loads(sys.argv[2])}, log_to_driver=False)
nodes = [{"address": n["NodeManagerAddress"], "id": n["NodeID"]} for n in ray.nodes() if n.get("Alive")]
try:
    result = {"results": check_ray_nodes(timeout_s=float(sys.argv[3])), "nodes": nodes}
except Exception as exc:
    result = {
        "error_type": type(exc).__name__,
        "is_runtime_error": isinstance(exc, RuntimeError),
        "message": str(exc),
        "nodes": nodes,
    }
ray.shutdown()
print("@MARKER@" + json.dumps(result))
""".replace("@MARKER@", RESULT_MARKER)


def _run_preflight_job(ray, env_vars: dict[str, str], cwd: Path) -> dict:
    address = ray.get_runtime_context().gcs_address
    return _run_python(PREFLIGHT_DRIVER, _clean_env(), cwd, (address, json.dumps(env_vars), str(RAY_GET_TIMEOUT_S)))


@pytest.mark.slow
def test_preflight_imports_the_plugin_itself_so_entry_points_off_still_pass(ray_cluster, tmp_path):
    """With entry points off the probe still sees every registration: it imports the plugin explicitly, so it checks
    that respo_verl is importable on each node, not that the entry point works there."""
    result = _run_preflight_job(ray_cluster, {"VERL_USE_EXTERNAL_PLUGINS": "none"}, tmp_path)
    assert "error_type" not in result, result
    assert [r["registered"] for r in result["results"]] == [ALL_REGISTERED]


@pytest.fixture(scope="module")
def preflight_without_package(ray_cluster, tmp_path_factory):
    """The preflight on a cluster whose workers cannot import respo_verl.

    Workers get a ``PYTHONPATH`` entry holding a ``respo_verl`` package that raises ImportError; it comes before
    site-packages (and setuptools' editable finder), so it shadows the installed package as an absent install would.
    """
    root = tmp_path_factory.mktemp("no_respo_verl")
    shadow = root / "shadow" / "respo_verl"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("respo_verl is not installed on this node (test shadow)")\n')
    cwd = root / "driver"
    cwd.mkdir()
    return _run_preflight_job(ray_cluster, {"PYTHONPATH": str(shadow.parent)}, cwd)


@pytest.mark.slow
def test_preflight_fails_on_a_node_without_the_package(preflight_without_package):
    result = preflight_without_package
    assert "results" not in result, "the preflight passed on a node that cannot import respo_verl"
    assert result["is_runtime_error"], result
    assert "respo_verl is not installed on this node (test shadow)" in result["message"]


@pytest.mark.slow
def test_preflight_failure_names_the_node_and_the_fix(preflight_without_package):
    result = preflight_without_package
    assert result["error_type"] == "RuntimeError"
    message = result["message"]
    assert message.startswith("respo-verl preflight failed on node ")
    for node in result["nodes"]:
        assert f"node {node['address']}: the probe could not run" in message
    assert "install respo-verl" in message and INSTALL_HINT in message
