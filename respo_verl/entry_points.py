"""The names by which verl, Hydra, Ray and pip reach this package: one home for each.

Imports nothing. pyproject.toml and the presets repeat some of these strings (they cannot import Python); tests keep
them equal to the constants here.
"""

DISTRIBUTION = "respo-verl"
# The verl.plugins entry point and the module the presets put in VERL_USE_EXTERNAL_MODULES: losses, estimator, engines.
PLUGIN_MODULE = "respo_verl.verl.plugin"
# The module the +device=cpu presets add to VERL_USE_EXTERNAL_MODULES: switches each Ray process to verl on CPU.
CPU_MODULE = "respo_verl.cpu.activate"
# The package the presets ship in (the top-level configs/ folder) and our entry point's primary config.
CONFIG_PACKAGE = "respo_verl.configs"
PRIMARY_CONFIG = "respo_trainer"

INSTALL_HINT = (
    "install respo-verl in the Python environment of every node that runs verl (pip install from the checkout or a "
    "git URL; the README's Quick start), or select a loss that verl ships"
)
