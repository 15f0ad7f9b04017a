"""Ray's private names in their one home (:mod:`respo_verl.patches.ray_private`): each is in the installed Ray, a name
a Ray release dropped fails loudly naming it, and no other module of the package reaches one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import ray
from ray.experimental import internal_kv

from respo_verl.patches import ray_private
from respo_verl.patches.ray_private import PrivateRayError

PACKAGE = Path(__file__).resolve().parents[2] / "respo_verl"
PRIVATE = re.compile(r"ray\._private|_internal_kv|__ray_")


def test_no_module_but_the_seam_reaches_a_private_name_of_ray():
    found = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if PRIVATE.search(path.read_text()) and path.name != "ray_private.py"
    )
    assert found == []


def test_the_tested_release_is_the_installed_one():
    assert ray.__version__ == ray_private.TESTED


def test_every_private_name_is_in_the_installed_ray(monkeypatch):
    import ray._private.state
    import ray._private.worker

    assert callable(ray_private._private("ray._private.state", "actors", "x"))
    assert ray_private.driver_node() is ray._private.worker._global_node
    monkeypatch.setattr(ray._private.worker, "_worker_logs_enabled", True)  # this process's Ray, restored after
    ray_private.stop_log_echo()
    assert ray._private.worker._worker_logs_enabled is False
    for name in ("_internal_kv_put", "_internal_kv_get", "_internal_kv_del"):
        assert callable(getattr(internal_kv, name))


@pytest.mark.parametrize(
    ("call", "module", "name"),
    [
        (lambda: ray_private.kv_put("k", "v", "ns"), "ray.experimental.internal_kv", "_internal_kv_put"),
        (lambda: ray_private.kv_get("k", "ns"), "ray.experimental.internal_kv", "_internal_kv_get"),
        (ray_private.actor_table, "ray._private.state", "actors"),
        (ray_private.driver_node, "ray._private.worker", "_global_node"),
        (ray_private.stop_log_echo, "ray._private.worker", "_worker_logs_enabled"),
    ],
)
def test_a_name_a_ray_release_dropped_fails_loudly_naming_it(monkeypatch, call, module, name):
    import importlib

    monkeypatch.delattr(importlib.import_module(module), name)
    with pytest.raises(PrivateRayError, match=rf"respo-verl uses {re.escape(module)}\.{name}, which ray \S+ does not"):
        call()


def test_an_actor_without_the_built_in_methods_fails_loudly():
    class NoMethods:
        pass

    with pytest.raises(PrivateRayError, match="built-in actor method __ray_ready__"):
        ray_private.ready(NoMethods())
    with pytest.raises(PrivateRayError, match="built-in actor method __ray_call__"):
        ray_private.call(NoMethods(), len)
