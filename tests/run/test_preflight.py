"""The per-node requirement check (respo_verl.run.requirements.check_missing) against real imports.

Each case runs a fresh interpreter whose ``PYTHONPATH`` starts with a folder of stand-ins for the GPU stack
(vLLM, Transformer Engine, DeepEP, flash-attn, mbridge, Megatron-Bridge), as an install on a GPU node would provide
them; one of them is then replaced by a module that raises on import (a broken install) or refused by a meta-path
finder (an absent one), and the check must report that one piece in one line naming the package and the config key.
The ``+device`` presets' requirements (the real megatron-core and mbridge) are checked on this machine as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from functools import cache
from pathlib import Path

import pytest
from conftest import compose

from respo_verl.run.requirements import Requirement, job_requirements

PAPER_PRESET = "qwen3_30b_a3b_h200_1x8"
MG = "actor_rollout_ref.actor.megatron"
TF = f"{MG}.override_transformer_config"
# Stand-ins that import fine. megatron is a namespace package (megatron-core ships no megatron/__init__.py), so the
# megatron/core and megatron/bridge folders here are found first without a megatron/__init__.py hiding anything.
# megatron.core is stood in for too: the real one reads Transformer Engine's package metadata, which a stand-in
# lacks (the CPU presets' case below imports the real one).
GOOD_STACK = {
    "vllm/__init__.py": "",
    "transformer_engine/__init__.py": "",
    "deep_ep.py": "",
    "flash_attn/__init__.py": "",
    "mbridge/__init__.py": "",
    "megatron/core/__init__.py": "",
    "megatron/bridge/__init__.py": "",
}
CHECK = """
import json, sys

refused = set(json.loads(sys.argv[2]))


class Refuse:
    # Makes an installed module look absent, without hiding its parent package.
    def find_spec(self, name, path=None, target=None):
        if name in refused:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, Refuse())
if json.loads(sys.argv[3]):  # a node with 8 GPUs
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 8
from respo_verl.run.requirements import Requirement, check_missing

reqs = [Requirement(**{**r, "alternatives": tuple(r["alternatives"])}) for r in json.loads(sys.argv[1])]
print("@RESULT@" + json.dumps(check_missing(reqs)))
"""


@cache
def _requirements(*overrides: str) -> tuple[Requirement, ...]:
    cfg = compose(["algorithm=respo", f"+cluster={PAPER_PRESET}", "+task=dapo_math_overlong", *overrides])
    return tuple(job_requirements(cfg))


def _check(
    reqs,
    tmp_path: Path,
    stubs: dict[str, str] | None = None,
    refuse: tuple[str, ...] = (),
    gpus: bool = True,
    shadow_stack: bool = True,
) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if shadow_stack:
        shadow = tmp_path / "shadow"
        for rel, text in {**GOOD_STACK, **(stubs or {})}.items():
            (shadow / rel).parent.mkdir(parents=True, exist_ok=True)
            (shadow / rel).write_text(text)
        env["PYTHONPATH"] = str(shadow)
    args = [json.dumps([asdict(r) for r in reqs]), json.dumps(list(refuse)), json.dumps(gpus)]
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.rsplit("@RESULT@", 1)[1])


def test_the_papers_stack_present_passes(tmp_path):
    assert _check(_requirements(), tmp_path) == []


@pytest.mark.parametrize(
    "stub, content, module, key, reason",
    [
        (
            "deep_ep.py",
            'raise ImportError("libibverbs.so.1: cannot open shared object file (test shadow)")\n',
            "deep_ep",
            f"{TF}.moe_token_dispatcher_type=flex",
            "ImportError: libibverbs.so.1: cannot open shared object file (test shadow)",
        ),
        (
            "vllm/__init__.py",
            'raise RuntimeError("vllm was built for another torch (test shadow)")\n',
            "vllm",
            "actor_rollout_ref.rollout.name=vllm",
            "RuntimeError: vllm was built for another torch (test shadow)",
        ),
        (
            "transformer_engine/__init__.py",
            'raise OSError("libtransformer_engine.so: undefined symbol (test shadow)")\n',
            "transformer_engine",
            "actor_rollout_ref.actor.strategy=megatron",
            "OSError: libtransformer_engine.so: undefined symbol (test shadow)",
        ),
        (
            "mbridge/__init__.py",
            'raise ImportError("mbridge needs another megatron-core (test shadow)")\n',
            "mbridge",
            f"{MG}.vanilla_mbridge=true",
            "ImportError: mbridge needs another megatron-core (test shadow)",
        ),
        (
            "flash_attn/__init__.py",
            'raise ImportError("flash_attn_2_cuda: undefined symbol (test shadow)")\n',
            "flash_attn",
            f"{TF}.attention_backend=flash",
            "ImportError: flash_attn_2_cuda: undefined symbol (test shadow)",
        ),
    ],
    ids=["deep_ep", "vllm", "transformer_engine", "mbridge", "flash_attn"],
)
def test_a_broken_package_is_one_line_naming_it_and_the_key(tmp_path, stub, content, module, key, reason):
    (line,) = _check(_requirements(), tmp_path, stubs={stub: content})
    assert f"import {module}" in line and reason in line
    assert f"needed by {key}" in line


def test_an_absent_megatron_bridge_is_named_with_vanilla_mbridge(tmp_path):
    reqs = _requirements(f"{MG}.vanilla_mbridge=false")
    (line,) = _check(reqs, tmp_path, refuse=("megatron.bridge",))
    assert line.startswith("Megatron-Bridge (import megatron.bridge): not installed")
    assert line.endswith(f"needed by {MG}.vanilla_mbridge=false")


def test_flash_attn_3_alone_satisfies_transformer_engines_flash_backend(tmp_path):
    stubs = {"flash_attn/__init__.py": 'raise ImportError("absent (test shadow)")\n', "flash_attn_3/__init__.py": ""}
    assert _check(_requirements(), tmp_path, stubs=stubs) == []


def test_a_node_without_cuda_is_named_with_the_gpu_count(tmp_path):
    (line,) = _check(_requirements(), tmp_path, gpus=False)  # this machine's torch has no CUDA
    assert line.startswith("8 CUDA GPU(s) per node: torch ")
    assert line.endswith("needed by trainer.device=cuda, trainer.n_gpus_per_node=8")


@pytest.mark.slow  # the probe in a fresh interpreter, once per preset (8-12 s)
def test_the_cpu_presets_pass_on_this_machine_as_it_is(tmp_path):
    for overrides in (["+device=cpu"], ["+device=cpu_megatron", "model_engine=megatron"]):
        reqs = job_requirements(compose(["algorithm=respo", *overrides]))
        assert _check(reqs, tmp_path, gpus=False, shadow_stack=False) == [], overrides


# A driver of its own with a one-CPU local Ray: its workers inherit the PYTHONPATH with the broken DeepEP.
RAY_DRIVER = """
import json, sys
import ray
from respo_verl.run.preflight import check_ray_nodes
from respo_verl.run.requirements import Requirement

reqs = [Requirement(**{**r, "alternatives": tuple(r["alternatives"])}) for r in json.loads(sys.argv[1])]
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=sys.argv[2])
nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
try:
    check_ray_nodes(timeout_s=120, requirements=reqs)
    result = {"passed": True, "nodes": nodes}
except RuntimeError as exc:
    result = {"passed": False, "message": str(exc), "nodes": nodes}


@ray.remote(num_cpus=0)
def visible_devices():
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


result["plain_task_sees"] = ray.get(visible_devices.remote())  # a task that asks for no GPU, as the probe does
ray.shutdown()
print("@RESULT@" + json.dumps(result))
"""


def _ray_preflight(reqs, tmp_path: Path, **env_vars: str) -> dict:
    """Runs :data:`RAY_DRIVER` with ``reqs`` in a fresh interpreter whose environment adds ``env_vars``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    env.update(HF_HUB_OFFLINE="1", TORCH_COMPILE_DISABLE="1", **env_vars)
    temp_dir = tempfile.mkdtemp(prefix="rv", dir="/tmp")  # Ray's socket paths must stay short
    args = [json.dumps([asdict(r) for r in reqs]), temp_dir]
    proc = subprocess.run(
        [sys.executable, "-c", RAY_DRIVER, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.rsplit("@RESULT@", 1)[1])


@pytest.mark.slow
def test_the_ray_preflight_names_the_node_the_package_and_the_key(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "deep_ep.py").write_text('raise ImportError("no DeepEP on this node (test shadow)")\n')
    reqs = [r for r in _requirements() if r.module in ("deep_ep", "megatron.core")]
    result = _ray_preflight(reqs, tmp_path, PYTHONPATH=str(shadow))
    assert not result["passed"]
    first, *lines = result["message"].splitlines()
    assert first.startswith("respo-verl preflight failed on 1 node(s)")
    (node,) = result["nodes"]
    (line,) = lines  # megatron.core imports there: only DeepEP is reported
    assert line.startswith(f"node {node} (")
    assert "DeepEP (import deep_ep): import fails (ImportError: no DeepEP on this node (test shadow))" in line
    assert line.endswith(f"needed by {TF}.moe_token_dispatcher_type=flex (moe_flex_dispatcher_backend=deepep)")


@pytest.mark.slow
def test_the_ray_preflight_counts_the_gpus_the_node_shows_not_the_none_ray_gives_a_task_without_gpus(tmp_path):
    """Ray releases before 2026 set CUDA_VISIBLE_DEVICES="" in a task that asks for no GPU, which is how the probe
    runs, so every node would have shown 0 GPUs; RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1 brings that behaviour back
    on the Ray here. The probe keeps the node's variable ("3" here; this machine has no GPU, so the check still
    fails, and names it)."""
    (gpu,) = [r for r in _requirements() if r.gpus]
    result = _ray_preflight([gpu], tmp_path, RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="1", CUDA_VISIBLE_DEVICES="3")
    assert result["plain_task_sees"] == ""  # the hazard, on this Ray
    assert not result["passed"]
    (line,) = result["message"].splitlines()[1:]
    assert "sees no CUDA device with CUDA_VISIBLE_DEVICES='3' (torch.cuda.is_available() is False)" in line, line
    assert line.endswith("needed by trainer.device=cuda, trainer.n_gpus_per_node=8")


def test_the_entry_point_passes_the_jobs_requirements_and_exits_2_on_a_failed_preflight(monkeypatch, capsys, tmp_path):
    import respo_verl.run.preflight as preflight
    from respo_verl.run.jobcheck import Job
    from respo_verl.run.launch import with_driver_hooks

    seen = {}

    def failing_preflight(timeout_s=preflight.PREFLIGHT_TIMEOUT_S, requirements=(), folders=None):
        seen["requirements"], seen["folders"] = tuple(requirements), folders
        raise RuntimeError("respo-verl preflight failed on 1 node(s): ...\nnode 10.0.0.7 (gpu-07): DeepEP ...")

    class Runner:
        @staticmethod
        def remote(*args, **kwargs):
            raise AssertionError("the runner started after a failed preflight")

    monkeypatch.setattr(preflight, "check_ray_nodes", failing_preflight)
    root = tmp_path / "ckpt"
    config = compose(
        ["algorithm=respo", f"+cluster={PAPER_PRESET}", "+task=dapo_math_overlong", f"trainer.default_local_dir={root}"]
    )
    with pytest.raises(SystemExit) as exit_info:
        with_driver_hooks(Runner, Job.of(config)).remote()
    assert exit_info.value.code == 2
    assert seen["requirements"] == _requirements()
    assert Path(seen["folders"].marker).parent == root  # the driver's marker every node must see
    err = capsys.readouterr().err
    assert err.startswith("respo_verl.main_ppo: respo-verl preflight failed on 1 node(s)")
    assert "node 10.0.0.7 (gpu-07): DeepEP" in err


def test_the_taskrunner_asks_for_its_resources_and_one_no_node_has_is_refused(monkeypatch, capsys, tmp_path):
    """``ray_kwargs.task_runner_resources`` reach the TaskRunner's options; a resource that no node of the cluster
    has is refused in one line, exit 2 (the TaskRunner would wait for ever). Ray itself is stood in for here: the
    two-node test (tests/cpu/test_two_nodes.py) places a real TaskRunner by such a resource."""
    import ray

    import respo_verl.run.launch as launch
    import respo_verl.run.preflight as preflight
    from respo_verl.run.jobcheck import Job

    asked = []

    class Runner:
        @staticmethod
        def options(**options):
            asked.append(options)
            return Runner

        @staticmethod
        def remote(*args, **kwargs):
            return "runner"

    monkeypatch.setattr(preflight, "check_ray_nodes", lambda **kwargs: None)
    monkeypatch.setattr(launch, "start_watchdog", lambda job: None)
    monkeypatch.setattr(launch, "stop_on_sigterm", lambda: False)
    overrides = ["algorithm=respo", f"trainer.default_local_dir={tmp_path}"]
    job = Job.of(compose([*overrides, "+ray_kwargs.task_runner_resources={trainer_node:1}"]))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "trainer_node": 1.0})
    assert launch.with_driver_hooks(Runner, job).remote() == "runner"
    assert asked == [{"resources": {"trainer_node": 1.0}}]
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    with pytest.raises(SystemExit) as exit_info:
        launch.with_driver_hooks(Runner, job).remote()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "respo_verl.main_ppo: ray_kwargs.task_runner_resources: no node of the cluster has ['trainer_node']\n"
    )
    assert launch.with_driver_hooks(Runner, Job.of(compose(overrides))).options(max_concurrency=2).remote() == "runner"
    assert asked[-1] == {"max_concurrency": 2}  # none asked: Ray's choice
