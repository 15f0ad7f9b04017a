"""The one patch helper: it records every change and undoes it, applies once, and refuses an untested version."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types

import pytest

import respo_verl
from respo_verl import patches
from respo_verl.patches import Patch, UntestedVersionError


def _every_patch() -> list[Patch]:
    """Every Patch object defined at module level anywhere in the package (the activation module left out)."""
    found = []
    for info in pkgutil.walk_packages(respo_verl.__path__, "respo_verl."):
        if info.name == "respo_verl.cpu.activate" or info.name.endswith(".__main__"):
            continue
        module = importlib.import_module(info.name)
        found += [v for v in vars(module).values() if isinstance(v, Patch) and v not in found]
    return found


def test_the_package_defines_the_patches_the_index_lists():
    names = {p.name for p in _every_patch()}
    index = patches.__file__ and __import__("pathlib").Path(respo_verl.__file__).parents[1] / "patches" / "README.md"
    text = index.read_text()
    assert len(names) == 17, sorted(names)
    for patch in _every_patch():
        assert patch.name in text, f"patches/README.md does not list {patch.name!r}"
        assert f"{patch.distribution} {patch.tested}" in text, f"patches/README.md lacks the guard of {patch.name!r}"


@pytest.mark.parametrize("patch", _every_patch(), ids=lambda p: p.name)
def test_every_patch_refuses_an_untested_version_in_one_line_naming_both(patch, monkeypatch):
    patch.check_version(patch.tested)  # the tested version passes
    with pytest.raises(UntestedVersionError) as info:
        patch.check_version("0.0.0")
    message = str(info.value)
    assert "\n" not in message and f"{patch.distribution} {patch.tested}" in message and "0.0.0" in message
    if patch.applied:
        return
    monkeypatch.setattr(patches, "installed_version", lambda distribution: "0.0.0")
    with pytest.raises(UntestedVersionError):
        patch.apply()
    assert not patch.applied and patch.describe() == []


def _owner() -> types.SimpleNamespace:
    return types.SimpleNamespace(value=1)


def test_changes_are_recorded_and_undone_newest_first(monkeypatch):
    monkeypatch.setattr(patches, "installed_version", lambda distribution: "1.0")
    owner, table, undone = _owner(), {"kept": 1}, []

    def install(patch: Patch) -> None:
        assert patch.replace(owner, "value", 2, "a reason") == 1
        patch.replace(owner, "added", 3)
        patch.set_item(table, "kept", 10, where="table", why="no public setter")
        patch.set_item(table, "new", 11, where="table", why="no public setter")
        patch.on_remove(lambda: undone.append("public"), "a registration")

    patch = Patch("test patch", "some-lib", "1.0", install)
    assert patch.apply() is True and patch.apply() is False
    assert (owner.value, owner.added, table) == (2, 3, {"kept": 10, "new": 11})
    assert patch.describe()[0] == "SimpleNamespace.value: a reason"
    assert patch.remove() is True and patch.remove() is False
    assert (owner.value, hasattr(owner, "added"), table, undone) == (1, False, {"kept": 1}, ["public"])


def test_a_failing_install_leaves_nothing_behind(monkeypatch):
    monkeypatch.setattr(patches, "installed_version", lambda distribution: "1.0")
    owner = _owner()

    def install(patch: Patch) -> None:
        patch.replace(owner, "value", 2)
        raise RuntimeError("half-way")

    patch = Patch("test patch", "some-lib", "1.0", install)
    with pytest.raises(RuntimeError, match="half-way"):
        patch.apply()
    assert owner.value == 1 and not patch.applied


def test_a_private_table_write_must_say_why(monkeypatch):
    monkeypatch.setattr(patches, "installed_version", lambda distribution: "1.0")
    patch = Patch("test patch", "some-lib", "1.0", lambda p: p.set_item({}, "k", 1, where="t", why=""))
    with pytest.raises(ValueError, match="must say why"):
        patch.apply()


def test_after_import_waits_for_the_module_and_its_hook_is_removed(monkeypatch, tmp_path):
    monkeypatch.setattr(patches, "installed_version", lambda distribution: "1.0")
    (tmp_path / "respo_late_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []
    patch = Patch(
        "test patch", "some-lib", "1.0", lambda p: p.after_import("respo_late_module", lambda: calls.append(1))
    )
    patch.apply()
    assert calls == []
    importlib.import_module("respo_late_module")
    assert calls == [1]
    patch.remove()
    sys.modules.pop("respo_late_module")
    never = Patch("other", "some-lib", "1.0", lambda p: p.after_import("respo_late_module", lambda: calls.append(2)))
    never.apply()
    never.remove()
    importlib.import_module("respo_late_module")
    assert calls == [1], "a removed hook does not run"
