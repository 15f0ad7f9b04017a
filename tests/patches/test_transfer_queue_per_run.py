"""A TransferQueue controller of its own for every run (:mod:`respo_verl.patches.transfer_queue_0_1_11`).

Fast: two Ray jobs get two namespaces; the patched modules create and look up their named actors there and pass every
other name through to Ray and to the actor class; the plugin applies the patch; ``remove()`` puts both names back.

Slow, on one real local Ray cluster with the real TransferQueue actors (controller and one storage unit per run):
two drivers, two "runs" as verl's are two Ray jobs, each ``tq.init`` and ``kv_put`` of a key while the other lives.
Patched, each run's queue holds its own key only, both storage units ``TransferQueueStorageUnit#0`` live at once,
and the first run's queue outlives the second run's ``tq.close()``; unpatched (the control), the second run finds
the first's controller and lists the first run's key. No verl trainer runs here: a two-verl-runs-at-once check is
a manual command (docs/comparing.md, "`respo-verl sweep`").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import types

import pytest

from respo_verl.patches import transfer_queue_0_1_11 as per_run
from respo_verl.patches.transfer_queue_0_1_11 import PER_RUN_CONTROLLER, SHARED_NAMESPACE

TIMEOUT_S = 180


@pytest.fixture
def applied():
    """The patch applied for the test, and left as it was found (the plugin applies it in any process that loaded
    verl's entry points)."""
    was_applied = PER_RUN_CONTROLLER.applied
    PER_RUN_CONTROLLER.apply()
    import transfer_queue.interface  # noqa: F401  (the import the patch waits for)

    yield
    if not was_applied:
        PER_RUN_CONTROLLER.remove()


def _job(monkeypatch, job_id: str) -> None:
    import ray

    context = types.SimpleNamespace(get_job_id=lambda: job_id)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)


def test_two_ray_jobs_get_two_namespaces_neither_the_shared_one(monkeypatch):
    _job(monkeypatch, "01000000")
    first = per_run.run_namespace()
    _job(monkeypatch, "02000000")
    second = per_run.run_namespace()
    assert (first, second) == ("transfer_queue-01000000", "transfer_queue-02000000")


def test_the_patched_modules_name_their_actors_in_the_runs_namespace(applied, monkeypatch):
    import ray
    from transfer_queue import interface
    from transfer_queue.controller import TransferQueueController

    _job(monkeypatch, "03000000")
    looked_up, options = [], []
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: looked_up.append((name, namespace)))
    monkeypatch.setattr(TransferQueueController, "options", lambda **kw: options.append(kw))
    interface.ray.get_actor("TransferQueueController", namespace=SHARED_NAMESPACE)
    interface.ray.get_actor("TransferQueueStorageUnit#0")  # no namespace: the job's own, unchanged
    interface.ray.get_actor("other", namespace="elsewhere")
    assert looked_up == [
        ("TransferQueueController", "transfer_queue-03000000"),
        ("TransferQueueStorageUnit#0", None),
        ("other", "elsewhere"),
    ]
    interface.TransferQueueController.options(name="TransferQueueController", namespace=SHARED_NAMESPACE)
    assert options == [{"name": "TransferQueueController", "namespace": "transfer_queue-03000000"}]
    # every other name is Ray's own and the class's own
    assert interface.ray.get is ray.get and interface.ray.kill is ray.kill
    assert interface.TransferQueueController.remote == TransferQueueController.remote


def test_remove_puts_the_modules_names_back(applied):
    import ray
    from transfer_queue import interface
    from transfer_queue.controller import TransferQueueController

    assert isinstance(vars(interface)["ray"], per_run.RayOfTheRun)
    PER_RUN_CONTROLLER.remove()
    try:
        assert vars(interface)["ray"] is ray and vars(interface)["TransferQueueController"] is TransferQueueController
    finally:
        PER_RUN_CONTROLLER.apply()
    assert isinstance(vars(interface)["TransferQueueController"], per_run.ActorClassOfTheRun)


def test_the_plugin_applies_it():
    import respo_verl.verl.plugin  # noqa: F401

    assert PER_RUN_CONTROLLER.applied


# One run's driver: joins the cluster as a Ray job of its own, starts (or, unpatched, finds) TransferQueue with one
# storage unit, puts its key, and prints the keys its queue lists; on a line on stdin it lists them again and closes.
RUN = r"""
import json, sys
import ray
address, key, patched = sys.argv[1], sys.argv[2], sys.argv[3] == "patched"
if patched:
    from respo_verl.patches.transfer_queue_0_1_11 import PER_RUN_CONTROLLER, run_namespace
    PER_RUN_CONTROLLER.apply()
ray.init(address=address, log_to_driver=False, logging_level="ERROR")
import torch
import transfer_queue as tq
from omegaconf import OmegaConf

def keys():
    return sorted(k for partition in tq.kv_list().values() for k in partition)

tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
tq.kv_put(key=key, partition_id="train", fields={"x": torch.tensor([1.0])})
unit = ray.get_actor("TransferQueueStorageUnit#0") if patched else None  # in this job's own namespace
print(json.dumps({"keys": keys(), "namespace": run_namespace() if patched else None}), flush=True)
sys.stdin.readline()
print(json.dumps({"keys": keys()}), flush=True)
tq.close()
ray.shutdown()
"""


class Run:
    """One run's driver process (:data:`RUN`), driven line by line."""

    def __init__(self, address: str, key: str, patched: bool, cwd: str) -> None:
        mode = "patched" if patched else "unpatched"
        env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "RAY_ADDRESS")}
        self.process = subprocess.Popen(
            [sys.executable, "-c", RUN, address, key, mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
        )  # fmt: skip

    def answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=TIMEOUT_S)
            pytest.fail(
                f"the run's driver ended (status {self.process.returncode}): {self.process.stderr.read()[-3000:]}"
            )
        return json.loads(line)

    def next(self) -> dict:
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        return self.answer()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def end(self) -> int:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("\n")
                self.process.stdin.close()
                self.process.wait(timeout=TIMEOUT_S)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@pytest.fixture(scope="module")
def cluster():
    import ray

    temp = tempfile.mkdtemp(prefix="rvtq", dir="/tmp")  # Ray's socket paths must stay short
    cwd = tempfile.mkdtemp(prefix="rvtq-cwd")  # the drivers' folder: Ray puts it on every worker's sys.path
    assert not ray.is_initialized()
    ray.init(num_cpus=6, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address, cwd
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(cwd, ignore_errors=True)


@pytest.mark.slow
def test_two_runs_at_once_each_have_their_own_queue(cluster):
    address, cwd = cluster
    first = Run(address, "a", patched=True, cwd=cwd)
    second = None
    try:
        started = first.answer()
        assert started["keys"] == ["a"]
        second = Run(address, "b", patched=True, cwd=cwd)
        other = second.answer()
        assert other["keys"] == ["b"], "the second run found the first run's queue"
        assert started["namespace"] != other["namespace"]
        assert second.next()["keys"] == ["b"] and second.end() == 0  # the second run closes its TransferQueue ...
        assert first.next()["keys"] == ["a"]  # ... and the first run's queue is still there
        assert first.end() == 0
    finally:
        for run in (first, second):
            if run is not None:
                run.end()


@pytest.mark.slow
def test_unpatched_the_second_run_finds_the_first_runs_queue(cluster):
    """The control: the failure the patch removes is TransferQueue's, on this cluster."""
    address, cwd = cluster
    first = Run(address, "a", patched=False, cwd=cwd)
    second = None
    try:
        assert first.answer()["keys"] == ["a"]
        second = Run(address, "b", patched=False, cwd=cwd)
        assert second.answer()["keys"] == ["a", "b"]
    finally:
        for run in (second, first):  # killed: the second run's close() would end the first run's controller
            if run is not None:
                run.kill()
