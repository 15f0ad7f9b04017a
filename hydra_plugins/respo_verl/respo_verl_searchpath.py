"""Hydra search-path plugin: makes respo_verl's config groups visible to every Hydra app, verl's main_ppo included.

With it, ``python -m verl.trainer.main_ppo +algorithm=respo ...`` finds ``algorithm/respo.yaml``. Hydra discovers
this module by scanning the ``hydra_plugins`` namespace package; it must not import verl.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from respo_verl.entry_points import CONFIG_PACKAGE, DISTRIBUTION

CONFIG_PROVIDER = DISTRIBUTION
CONFIG_PATH = f"pkg://{CONFIG_PACKAGE}"  # the top-level configs/ folder, shipped under this name


class RespoVerlSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider=CONFIG_PROVIDER, path=CONFIG_PATH)
