"""Runtime changes to upstream libraries, all made through one helper, :class:`Patch`.

A :class:`Patch` is a named set of changes to one library at the version it was tested with. It records every
replacement it makes (an attribute, an entry of a private table, a callback run when a module is first imported),
undoes them in reverse order, and refuses to apply to any other installed version with one line naming both. Nothing
is changed on import: each feature applies its patches by one explicit call from the place that needs it (the CPU
runtime, an engine subclass).

One module per patched library and version holds that library's patches: :mod:`.verl_0_9_1`,
:mod:`.megatron_core_0_16_1`, :mod:`.mbridge_0_15_1`; the one exception is :mod:`.meta_build`, the stand-ins of the
planner's meta-device build (megatron-core and mbridge), kept together so that their list is the build's list of
deviations. Registrations through a library's public registry that need
a guard and an undo use the same helper where they are defined (``respo_verl.cpu.runtime``,
``respo_verl.routing.engine``). The index of every patch, with its version guard and when to delete it, is the
repository's ``patches/README.md``.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

_MISSING = object()


class UntestedVersionError(RuntimeError):
    """A patch was asked to apply to a library version it was not tested with."""


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (its PyPI name), or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Change:
    """One recorded change: what was changed, and why (shown by :meth:`Patch.describe`)."""

    where: str
    why: str
    undo: Callable[[], None]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` right after the module ``name`` has been executed by the normal import machinery (once)."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_callback(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_callback
        return spec


class Patch:
    """Changes to ``distribution`` at version ``tested``, applied by ``install(patch)`` and recorded for undo.

    Args:
        name: what the patch does, in a few words (error messages and ``patches/README.md`` name it so).
        distribution: the patched library's distribution name (``verl``, ``megatron-core``, ``mbridge``).
        tested: the one version it was written and tested against; any other installed version is refused.
        install: makes the changes, only through :meth:`replace`, :meth:`set_item`, :meth:`after_import` and
            :meth:`on_remove`, so that every change is recorded.
    """

    def __init__(self, name: str, distribution: str, tested: str, install: Callable[[Patch], None]) -> None:
        self.name = name
        self.distribution = distribution
        self.tested = tested
        self._install = install
        self._changes: list[Change] = []
        self._applied = False

    def __repr__(self) -> str:
        state = "applied" if self._applied else "not applied"
        return f"Patch({self.name!r}, {self.distribution} {self.tested}, {state})"

    @property
    def applied(self) -> bool:
        return self._applied

    def check_version(self, installed: str | None = _MISSING) -> None:  # type: ignore[assignment]
        """Raise :class:`UntestedVersionError` unless ``installed`` (default: what is installed) is the tested one."""
        found = installed_version(self.distribution) if installed is _MISSING else installed
        if found != self.tested:
            raise UntestedVersionError(
                f"respo-verl patch '{self.name}' is tested with {self.distribution} {self.tested}, but "
                f"{self.distribution} {found or '(not installed)'} is installed; install {self.distribution}=="
                f"{self.tested} or a respo-verl release tested with {found}"
            )

    def apply(self) -> bool:
        """Check the version, then make the changes (once). Returns True if this call applied it.

        If ``install`` fails half-way, what it changed so far is undone before the error propagates.
        """
        if self._applied:
            return False
        self.check_version()
        try:
            self._install(self)
        except BaseException:
            self._undo()
            raise
        self._applied = True
        return True

    def remove(self) -> bool:
        """Undo every recorded change, newest first. Returns True if the patch was applied."""
        if not self._applied:
            return False
        self._undo()
        self._applied = False
        return True

    def _undo(self) -> None:
        while self._changes:
            self._changes.pop().undo()

    def describe(self) -> list[str]:
        """One line per recorded change: where, and why."""
        return [f"{change.where}: {change.why}" for change in self._changes]

    # -- the only ways a patch changes anything ---------------------------------------------------------------

    def replace(self, owner: Any, attribute: str, value: Any, why: str = "") -> Any:
        """Set ``owner.attribute = value``; returns what was there (None if nothing)."""
        original = vars(owner).get(attribute, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        setattr(owner, attribute, value)

        def undo() -> None:
            if original is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)

        self._changes.append(Change(f"{_name(owner)}.{attribute}", why, undo))
        return None if original is _MISSING else original

    def set_item(self, table: MutableMapping, key: Any, value: Any, where: str, why: str) -> None:
        """``table[key] = value`` for a table the library offers no public way to change; ``why`` says so."""
        if not why:
            raise ValueError(f"patch '{self.name}': a write to the private table {where} must say why")
        original = table.get(key, _MISSING)
        table[key] = value

        def undo() -> None:
            if original is _MISSING:
                table.pop(key, None)
            else:
                table[key] = original

        self._changes.append(Change(f"{where}[{key!r}]", why, undo))

    def after_import(self, module: str, callback: Callable[[], None], why: str = "") -> None:
        """Run ``callback`` now if ``module`` is imported, else right after the library imports it."""
        if module in sys.modules:
            callback()
            return
        finder = _AfterImport(module, callback)
        sys.meta_path.insert(0, finder)

        def undo() -> None:
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)

        self._changes.append(Change(f"import of {module}", why, undo))

    def on_remove(self, undo: Callable[[], None], where: str, why: str = "") -> None:
        """Record a change made through the library's public API (a registration) and how to take it back."""
        self._changes.append(Change(where, why, undo))


def _name(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__
