"""The respo-verl trainer: verl 0.9.1's synchronous PPO trainer with the guards a days-long run needs.

Registered through verl's public trainer registry as ``respo_sync`` (:data:`REGISTRATION`, applied by the plugin,
which waits until verl imports its V1 trainers) and selected by the algorithm presets with verl's own
``trainer.v1.trainer_mode``. It adds, to verl's ``PPOTrainerSync`` and nothing else:

- **checkpoints that know their run.** After verl has saved a checkpoint and logged its step's metrics,
  :mod:`respo_verl.run.checkpoint`'s marker (the run's fingerprint) is written into it; before verl resumes, the
  folder is checked: a checkpoint of another configuration stops the run, one without the marker (half-written, or
  its step's line never logged) is skipped loudly (:func:`respo_verl.run.checkpoint.plan_resume`).
- **a log that keeps every step.** verl's file logger opens its file with ``"wb"``; the trainer applies
  :data:`respo_verl.patches.verl_0_9_1.FILE_LOGGER_APPEND`, under which a resumed run appends to its log after a
  line that marks the resume (:data:`respo_verl.patches.verl_0_9_1.RESUME_EVENT`).
- **a stop on request.** When the driver has asked for a stop (SIGTERM; the request travels through Ray,
  :mod:`respo_verl.run.watchdog`), the trainer saves a checkpoint at the end of the current step and ends the run.
- **samples in the order of the data loader.** verl's replay buffer hands a step its samples in the order the
  rollouts finished; the trainer puts them in the data loader's order of their prompts, then by sample
  (:func:`respo_verl.run.hooks.in_prompt_order`), so that a step's batch, and every sum over it, does not depend on
  the rollouts' timing. Two runs with verl's ``rollout.full_determinism`` (and a resumed run and an uninterrupted
  one) then agree to the last bit in every metric, not only in the weights.
- **guards** on every step's metrics (:mod:`respo_verl.run.guards`, the ``run_guard`` node of the presets): samples
  whose reward or rollout failed above a share, and a collapsed policy, stop the run with the metric and the step
  named. A guard on a step's metrics first logs that step, to every logger verl was given, with
  ``respo_verl/stopped`` = 1 (:data:`respo_verl.run.guards.STOPPED_KEY`), then stops the run; non-finite rewards
  (the advantage computation) and log-probs (the loss) stop it naming the step.
- **the phase record** the driver's watchdog reads (:mod:`respo_verl.run.watchdog`): which phase of which step
  runs, what it waits on and whether it progresses; while verl's replay buffer waits for a step's samples, the
  actors the step waits on are checked for life (:mod:`respo_verl.run.liveness`); a dead actor that a ``ray.get`` of
  the step meets is named with its step too (:func:`respo_verl.run.stops.stop_for_error`).

The class is :class:`respo_verl.run.respo_trainer.RespoTrainer`, imported by the registration only (it imports verl).
Every stop is a :class:`respo_verl.run.stops.RunStopped`, whose class gives the entry point its one line and exit
status (:mod:`respo_verl.run.stops`).
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
