"""Hydra composition of a job exactly as either entry point composes it, without running it (``--cfg job`` in-process).

The one place that composes job configs: the planner, the sweep, the experiment adapter, the benchmarks and the
tests all come here. Composing does not import verl: Hydra resolves ``respo_trainer.yaml``'s
``pkg://verl.trainer.config`` by importing verl, so verl's config folder is found with
:func:`importlib.util.find_spec`, which does not execute the package, and handed to Hydra as a ``file://`` path; the
composed job is identical (docs/internals.md, "The planner's start-up time").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from respo_verl.entry_points import CONFIG_PACKAGE, PRIMARY_CONFIG

# The overrides verl's dataclass conversion (``omega_conf_to_dataclass`` / ``validate_config``) needs on a machine
# without a GPU cluster: a rollout backend name (verl's default is unset) and a per-GPU micro-batch for the actor
# (verl's default is null, which its actor config rejects when dynamic batch size is off).
CPU_COMPOSE_OVERRIDES = (
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
)

# entry -> (package holding the primary config, primary config name)
ENTRY_CONFIGS = {
    "respo": (CONFIG_PACKAGE, PRIMARY_CONFIG),  # python -m respo_verl.main_ppo
    "verl": ("verl.trainer.config", "ppo_trainer"),  # python -m verl.trainer.main_ppo (our groups via the plugin)
}
VERL_CONFIG_PACKAGE = ENTRY_CONFIGS["verl"][0]
SEARCHPATH_KEY = "hydra.searchpath"


class ComposeError(ValueError):
    """A job Hydra cannot compose (unknown entry, malformed or unknown override, missing config group option), in
    Hydra's or OmegaConf's words on one line, without the traceback."""


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it (or any of its parents) where possible.

    ``importlib.util.find_spec("a.b.c")`` imports ``a`` and ``a.b``; only the top-level lookup is import-free, so
    the rest of the dotted name is walked as folders. A sub-package that the build backend maps to a folder of its
    own (``respo_verl.configs`` is ``configs/`` in an editable install) is not below its parent's folder; it is
    then looked up through the import system, which imports its parents (for ``respo_verl``: the version only).

    Raises:
        ComposeError: the package is not installed or is not a folder on disk.
    """
    top, *rest = package.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise ComposeError(f"cannot find the installed package {top!r} (needed for {package!r})")
    for location in spec.submodule_search_locations:
        folder = Path(location).joinpath(*rest)
        if folder.is_dir():
            return folder
    if rest:
        try:
            mapped = importlib.util.find_spec(package)
        except ImportError:
            mapped = None
        for location in (mapped.submodule_search_locations or []) if mapped else []:
            if Path(location).is_dir():
                return Path(location)
    raise ComposeError(f"package {package!r} has no folder on disk under {list(spec.submodule_search_locations)}")


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return "; ".join(lines) if lines else type(err).__name__


def compose_job(entry: str, overrides: Sequence[str] = ()):
    """The job configuration (an OmegaConf DictConfig) of ``entry`` (:data:`ENTRY_CONFIGS`: ``"respo"``, where
    ``algorithm=...`` is a plain override, or ``"verl"``, where our groups come through the search-path plugin as
    ``+algorithm=...``) with Hydra command-line ``overrides``.

    Raises:
        ComposeError: unknown entry, or overrides Hydra rejects (message on one line, no traceback).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from respo_verl.run import resolvers

    resolvers.register()  # the presets' ${respo_verl.*:...} interpolations
    if entry not in ENTRY_CONFIGS:
        raise ComposeError(f"entry must be one of {sorted(ENTRY_CONFIGS)}, got {entry!r}")
    package, name = ENTRY_CONFIGS[entry]
    overrides = [str(o) for o in overrides]
    if entry == "respo" and not any(o.split("=", 1)[0].lstrip("+~") == SEARCHPATH_KEY for o in overrides):
        # Replaces respo_trainer.yaml's `pkg://verl.trainer.config` by the same folder as a file path.
        overrides.append(f"{SEARCHPATH_KEY}=[file://{package_dir(VERL_CONFIG_PACKAGE)}]")
    config_dir = str(package_dir(package))
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return compose(config_name=name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ComposeError(f"cannot compose the {entry!r} job: {_one_line(err)}") from None
    finally:
        GlobalHydra.instance().clear()
