"""Hydra composition of a job as either entry point composes it, without running it (``--cfg job`` in-process)."""

from __future__ import annotations

from collections.abc import Sequence

# entry -> (config module, primary config)
ENTRY_CONFIGS = {
    "respo": ("respo_verl.verl.conf", "respo_trainer"),  # python -m respo_verl.main_ppo
    "verl": ("verl.trainer.config", "ppo_trainer"),  # python -m verl.trainer.main_ppo (our groups via the plugin)
}


def compose_job(entry: str, overrides: Sequence[str] = ()):
    """The job configuration (an OmegaConf DictConfig) of ``entry`` with Hydra ``overrides``."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if entry not in ENTRY_CONFIGS:
        raise ValueError(f"entry must be one of {sorted(ENTRY_CONFIGS)}, got {entry!r}")
    module, name = ENTRY_CONFIGS[entry]
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=module, version_base=None):
        return compose(config_name=name, overrides=list(overrides))
