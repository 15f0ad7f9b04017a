"""The respo-verl trainer's registration: verl 0.9.1's synchronous PPO trainer with the guards a days-long run needs.

Registered through verl's public trainer registry as ``respo_sync`` (:data:`REGISTRATION`, applied by the plugin,
which waits until verl imports its V1 trainers) and selected by the algorithm presets with verl's own
``trainer.v1.trainer_mode``. The class, :class:`respo_verl.run.respo_trainer.RespoTrainer`, adds to verl's
``PPOTrainerSync``:

- **checkpoints that know their run**: a marker with the run's fingerprint (:mod:`respo_verl.run.checkpoint`),
  written once the step's line is logged and checked before a resume;
- **a log that keeps every step**: a resumed run appends to verl's file log
  (:data:`respo_verl.patches.verl_0_9_1.FILE_LOGGER_APPEND`);
- **a stop on request**: on SIGTERM the driver asks, through Ray; the trainer saves at the end of its step and ends;
- **samples in the data loader's order** (:func:`respo_verl.run.hooks.in_prompt_order`), so that a step's batch does
  not depend on the rollouts' timing and runs with verl's ``rollout.full_determinism`` agree to the last bit;
- **guards** on every step's metrics (:mod:`respo_verl.run.guards`): a guard's stop logs its step first, marked
  ``respo_verl/stopped`` = 1;
- **the phase record** the driver's watchdog bounds (:mod:`respo_verl.run.watchdog`), and the liveness of the actors
  a step waits on (:mod:`respo_verl.run.liveness`).

Every stop is a :class:`respo_verl.run.stops.RunStopped`, whose class gives the entry point its one line and exit
status.
"""

from __future__ import annotations

from respo_verl.patches import Patch

TRAINER_MODE = "respo_sync"
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_sync"

__all__ = ["REGISTRATION", "TRAINER_MODE"]


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
