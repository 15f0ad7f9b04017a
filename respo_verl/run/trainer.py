"""The respo-verl trainer's registration: verl 0.9.1's synchronous PPO trainer with the guards a days-long run needs.

Registered through verl's public trainer registry as ``respo_sync`` (:data:`REGISTRATION`, applied by the plugin,
which waits until verl imports its V1 trainers) and selected by the algorithm presets with verl's own
``trainer.v1.trainer_mode``. The class and what it adds to verl's ``PPOTrainerSync``:
:mod:`respo_verl.run.respo_trainer`; how it works: docs/internals.md, "The respo-verl trainer and its checkpoints".
"""

from __future__ import annotations

from respo_verl.patches import Patch

TRAINER_MODE = "respo_sync"
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_sync"
CLASS_MODULE = "respo_verl.run.respo_trainer"


def _register(patch: Patch) -> None:
    def add(cls: type) -> None:
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

        register_trainer(TRAINER_MODE)(cls)
        patch.on_remove(
            lambda: TRAINER_REGISTRY.pop(TRAINER_MODE, None),  # verl's registry has no public unregister
            f"TRAINER_REGISTRY[{TRAINER_MODE!r}]",
            "registered through register_trainer",
        )

    def register() -> None:
        import importlib
        import sys

        loading = sys.modules.get(CLASS_MODULE)
        if loading is not None and not hasattr(loading, "RespoTrainer"):
            # the class's module is being imported and its import of verl's trainer brought us here: it registers
            # the class through this step once it has defined it
            loading.register_when_defined = add
            return
        add(importlib.import_module(CLASS_MODULE).RespoTrainer)

    patch.after_import(TRAINER_MODULE, register, "register the respo-verl trainer once verl has its V1 trainers")


REGISTRATION = Patch("respo-verl trainer (trainer_mode respo_sync)", "verl", "0.9.1", _register)
