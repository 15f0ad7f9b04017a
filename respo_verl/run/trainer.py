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
- **a stop on request.** When :func:`respo_verl.run.checkpoint.stop_request` exists (the entry point writes it on
  SIGTERM), the trainer saves a checkpoint at the end of the current step and ends the run.
- **samples in the order of the data loader.** verl's replay buffer hands a step its samples in the order the
  rollouts finished; the trainer puts them in the data loader's order of their prompts, then by sample
  (:func:`in_prompt_order`), so that a step's batch, and every sum over it, does not depend on the rollouts' timing.
  Two runs with verl's ``rollout.full_determinism`` (and a resumed run and an uninterrupted one) then agree to the
  last bit in every metric, not only in the weights.
- **guards** on every step's metrics (:mod:`respo_verl.run.guards`, the ``run_guard`` node of the presets): samples
  whose reward or rollout failed above a share, and a collapsed policy, stop the run with the metric and the step
  named. A guard on a step's metrics first logs that step, to every logger verl was given, with
  ``respo_verl/stopped`` = 1 (:data:`respo_verl.run.guards.STOPPED_KEY`), then stops the run; non-finite rewards
  (the advantage computation) and log-probs (the loss) stop it naming the step.
- **the watchdog** over the waits verl would never end (:mod:`respo_verl.run.watchdog`): while verl's replay buffer
  waits for a step's samples, the actors the step waits on are checked for life, and a step in which no sample
  finishes for ``run_guard.max_stall_s`` is stopped; a dead actor that a ``ray.get`` of the step meets is named with
  its step too (:func:`respo_verl.run.stops.stop_for_error`).

Every stop is a :class:`respo_verl.run.stops.RunStopped`, whose class gives the entry point its one line and exit
status (:mod:`respo_verl.run.stops`).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from respo_verl.patches import Patch
from respo_verl.run.guards import EVICTED_GROUPS_KEY, STOPPED_KEY, GuardConfig, StepGuards, failed_sample_metrics
from respo_verl.run.stops import NonFinite, RunStopped, stop_for_error
from respo_verl.run.watchdog import (
    GENERATION_ACTORS,
    PhaseBoard,
    SampleWaitWatch,
    phase_file,
    waits_on,
    watch_replay_buffer,
    watched_actors,
)

logger = logging.getLogger(__name__)

TRAINER_MODE = "respo_sync"
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_sync"
# Popped by verl's loop before it logs a step: a table for its own logger, not a metric.
DAPO_COUNTS_KEY = "_dapo_filtered_reward_counts"

__all__ = ["REGISTRATION", "TRAINER_MODE", "in_prompt_order", "trainer_hooks"]


HOOKS_PATCH_NAME = "respo-verl trainer's logger and sampler hooks"


def trainer_hooks(logger: Any, after_log: Any, buffer: Any, reorder: Any) -> Patch:
    """The patch of the two verl objects one run's trainer holds (verl 0.9.1's ``Tracking`` and ``ReplayBuffer``):
    ``logger.log`` calls ``after_log(step)`` once a step's line is logged (the checkpoint marker waits for it), and
    ``buffer.sample`` returns its train batches through ``reorder`` (the data loader's order). Public methods of
    verl's objects, replaced on these two instances only."""

    def install(patch: Patch) -> None:
        log, sample = logger.log, buffer.sample

        def log_then_mark(*args, **kwargs):
            log(*args, **kwargs)
            after_log(kwargs.get("step", args[1] if len(args) > 1 else None))

        def sample_in_order(*args, **kwargs):
            batch, metrics = sample(*args, **kwargs)
            return (reorder(batch) if batch.partition_id == "train" else batch), metrics

        patch.replace(logger, "log", log_then_mark, "marks a saved step's checkpoint once the step's line is logged")
        patch.replace(buffer, "sample", sample_in_order, "train batches in the data loader's order")

    return Patch(HOOKS_PATCH_NAME, "verl", "0.9.1", install)


def in_prompt_order(batch, prompt_order: dict[str, int]):
    """``batch`` (a TransferQueue ``KVBatchMeta`` of the train partition) with its samples, and their tags, sorted
    by the data loader's position of their prompt (``prompt_order``: uid -> position), then by session and index.

    verl's keys are ``{uid}_{session_id}_{index}``; a key of another form, or a prompt the data loader never gave,
    is an error that names it.
    """

    def rank(key: str) -> tuple[int, int, int]:
        parts = key.split("_")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"sample key {key!r} is not verl's {{uid}}_{{session_id}}_{{index}}")
        if parts[0] not in prompt_order:
            raise ValueError(f"sample key {key!r}: its prompt {parts[0]!r} did not come from the train data loader")
        return prompt_order[parts[0]], int(parts[1]), int(parts[2])

    order = sorted(range(len(batch.keys)), key=lambda i: rank(batch.keys[i]))
    return dataclasses.replace(batch, keys=[batch.keys[i] for i in order], tags=[batch.tags[i] for i in order])


def _trainer_class() -> type:
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from respo_verl.patches import verl_0_9_1
    from respo_verl.run import checkpoint

    class RespoTrainer(PPOTrainerSync):
        """verl's ``PPOTrainerSync`` with the additions of :mod:`respo_verl.run.trainer`."""

        _board: PhaseBoard | None = None  # the phase record, with the guards on

        def __init__(self, config, *args, **kwargs):
            guard = GuardConfig.from_config(config.get("run_guard"))
            replay = OmegaConf.select(config, "actor_rollout_ref.actor.megatron.router_replay.mode", default=None)
            megatron = OmegaConf.select(config, "actor_rollout_ref.actor.strategy") == "megatron"
            log_probs = OmegaConf.select(config, "actor_rollout_ref.rollout.calculate_log_probs", default=True)
            self._guards = StepGuards(guard, routing_replay=replay if megatron else None, sampler_log_probs=log_probs)
            # The run's identity before verl adds its own keys (optimizer step counts, TransferQueue) to the config.
            self._run = checkpoint.identity(config)
            verl_0_9_1.FILE_LOGGER_APPEND.apply()
            self._prompt_order: dict[str, int] = {}  # uid -> position, for the train prompts not yet sampled
            self._prompts_fetched = 0
            # The phase of the step for the driver's phase deadline (respo_verl.run.watchdog.PhaseDeadline).
            folder = checkpoint.checkpoint_folder(config)
            self._board = PhaseBoard(phase_file(folder)) if guard.enable else None
            super().__init__(config, *args, **kwargs)

        @contextmanager
        def _phase(self, phase: str, *kinds: str, folder: Path | None = None):
            """Run a phase of the step under the driver's deadline; ``kinds``: the actors it waits on."""
            if self._board is None:
                yield
                return
            with self._board.phase(self.global_steps, phase, waits_on(self, *kinds), folder):
                yield

        def on_init_end(self):
            with self._phase("weight sync", "update worker", "rollout server"):
                super().on_init_end()
            if self._board is not None:
                self._board.pause("start-up: verl builds the agent loop")

        def on_sample_begin(self):
            if self._board is not None:
                self._board.enter(self.global_steps, "generation", waits_on(self, *GENERATION_ACTORS))
            super().on_sample_begin()

        def on_sample_end(self):
            super().on_sample_end()  # verl: the rollout servers release their weights and KV cache
            if self._board is not None:
                self._board.enter(self.global_steps, "between phases, after generation", waits_on(self))

        def on_validate_begin(self):
            if self._board is not None:
                self._board.enter(self.global_steps, "validation", waits_on(self, *GENERATION_ACTORS))
            super().on_validate_begin()

        def on_validate_end(self):
            super().on_validate_end()
            if self._board is not None:
                self._board.enter(self.global_steps, "between phases, after validation", waits_on(self))

        def _compute_reward_colocate(self, batch, metrics=None):
            with self._phase("reward", "reward worker"):
                return super()._compute_reward_colocate(batch, metrics=metrics)

        def _compute_old_log_prob(self, batch, metrics):
            with self._phase("old log-probs", "update worker"):
                return super()._compute_old_log_prob(batch, metrics)

        def _compute_ref_log_prob(self, batch, metrics):
            with self._phase("reference log-probs", "reference worker"):
                return super()._compute_ref_log_prob(batch, metrics)

        def _compute_values(self, batch, metrics):
            with self._phase("values", "critic worker"):
                return super()._compute_values(batch, metrics)

        def _update_critic(self, batch, metrics):
            with self._phase("critic update", "critic worker"):
                return super()._update_critic(batch, metrics)

        def _update_actor(self, batch, metrics):
            with self._phase("update", "update worker"):
                return super()._update_actor(batch, metrics)

        def _fetch_one_gen_batch(self):
            batch = super()._fetch_one_gen_batch()
            for uid in batch["uid"]:
                self._prompt_order[str(uid)] = self._prompts_fetched
                self._prompts_fetched += 1
            return batch

        def _load_checkpoint(self):
            plan = checkpoint.plan_resume(self.config, run=self._run)
            for line in plan.warnings:
                logger.warning("respo-verl: %s", line)
                print(f"respo-verl: WARNING: {line}", flush=True)
            if plan.resume_from is not None and self.config.trainer.resume_mode == "auto":
                from omegaconf import open_dict

                with open_dict(self.config.trainer):
                    self.config.trainer.resume_mode = "resume_path"
                    self.config.trainer.resume_from_path = str(plan.resume_from)
                try:
                    return super()._load_checkpoint()
                finally:
                    with open_dict(self.config.trainer):
                        self.config.trainer.resume_mode = "auto"
            return super()._load_checkpoint()

        def on_train_begin(self):
            super().on_train_begin()
            self._watch_sample_waits()
            # verl's Tracking and ReplayBuffer, built by fit() before this hook.
            self._hooks = trainer_hooks(self.logger, self._mark_saved_step, self.replay_buffer, self._in_prompt_order)
            self._hooks.apply()

        def _watch_sample_waits(self) -> None:
            """While the replay buffer waits for a step's samples, watch the actors the step waits on and the
            step's progress (:class:`SampleWaitWatch`); not with ``run_guard.enable=false``."""
            if not self._guards.config.enable:
                return
            request = checkpoint.stop_request(self.config)
            self._watch = SampleWaitWatch(
                self._guards.config, watched_actors(self), request.is_file, on_poll=self._board.progress
            )
            self._watch.progressed(self.global_steps)
            self._watch_patch = watch_replay_buffer(self.replay_buffer, self._watch)
            self._watch_patch.apply()

        def on_step_begin(self):
            super().on_step_begin()
            if getattr(self, "_watch", None) is not None:
                self._watch.progressed(self.global_steps)

        def fit(self, *args, **kwargs):
            try:
                return super().fit(*args, **kwargs)
            except RunStopped:
                raise
            except Exception as exc:  # a dead actor the step called, non-finite values: one line naming the step
                stop = stop_for_error(exc, self.global_steps)
                if stop is None:
                    raise
                raise stop from None
            finally:
                if self._board is not None:
                    self._board.end()

        def _in_prompt_order(self, batch):
            """A train batch of the replay buffer in the data loader's order (:func:`in_prompt_order`)."""
            ordered = in_prompt_order(batch, self._prompt_order)
            for key in ordered.keys:  # a prompt is sampled once: forget it (the run may last days)
                self._prompt_order.pop(key.split("_")[0], None)
            return ordered

        def _save_checkpoint(self):
            folder = Path(checkpoint.checkpoint_folder(self.config)) / f"global_step_{self.global_steps}"
            # a step saved again (after a resume from an earlier checkpoint): its old marker no longer describes it
            (folder / checkpoint.MARKER).unlink(missing_ok=True)
            with self._phase("save", "update worker", "critic worker", folder=folder):
                super()._save_checkpoint()
            self._saved_step = self.global_steps
            # verl logs the step's metrics after its save (and after validation): the marker waits for that line,
            # so that a run killed in between redoes the step from the checkpoint before instead of losing its line.
            self._unmarked_step = self.global_steps

        def _mark_saved_step(self, step) -> None:
            if step is None or getattr(self, "_unmarked_step", None) != step or getattr(self, "_stopping", False):
                return  # a step a guard stopped in is not a step to resume after
            folder = Path(checkpoint.checkpoint_folder(self.config)) / f"global_step_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            # every file the save wrote, for the check before a resume (a few reads per file: seconds)
            files = checkpoint.manifest(folder)
            checkpoint.write_marker_info(folder, {**self._run, "step": int(step), "files": files})
            self._unmarked_step = None

        def on_step_end(self):
            with self._phase("weight sync", "update worker", "rollout server"):
                super().on_step_end()  # verl: the rollout servers load the updated weights
            if getattr(self, "_watch", None) is not None:
                self._watch.progressed(self.global_steps)  # the update has run
            request = checkpoint.stop_request(self.config)
            if request.is_file() and self.global_steps < self.total_training_steps:
                if getattr(self, "_saved_step", None) != self.global_steps:
                    self._save_checkpoint()
                print(
                    f"respo-verl: stop requested ({request}): saved global_step_{self.global_steps}, ending the run",
                    flush=True,
                )
                request.unlink(missing_ok=True)
                self.total_training_steps = self.global_steps  # verl's loop ends after logging this step

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
            n = int(self.config.actor_rollout_ref.rollout.n)
            expected = int(self.config.data.train_batch_size) * n
            evicted = metrics.get(EVICTED_GROUPS_KEY, 0)
            metrics.update(failed_sample_metrics(list(batch.tags), expected, evicted, n))
            try:
                self._guards.check(metrics, global_steps)
            except RunStopped:
                self._log_stopping_step(metrics, global_steps)
                raise

        def _log_stopping_step(self, metrics: dict, step: int) -> None:
            """The step a guard stops in, logged as verl logs every step (its loop never gets to it), marked."""
            self._stopping = True
            data = {key: value for key, value in metrics.items() if key != DAPO_COUNTS_KEY}
            try:
                self.logger.log(data={**data, STOPPED_KEY: 1.0}, step=step)
                self.logger.finish(exit_code=1)  # flushes every backend (wandb, tensorboard, ...) before the raise
            except Exception as exc:  # the stop's own message must still reach the user
                print(f"respo-verl: WARNING: could not log step {step}, the step the run stops in: {exc!r}")

        def _compute_advantage(self, batch, metrics):
            try:
                return super()._compute_advantage(batch, metrics)
            except ValueError as exc:  # e.g. non-finite rewards: verl's message does not say which step
                # the step's metrics so far (generation, old log-probs), logged and marked like a guard's stop
                self._log_stopping_step(metrics, self.global_steps)
                raise NonFinite(f"step {self.global_steps}: {exc}") from exc

    return RespoTrainer


def _register(patch: Patch) -> None:
    def register() -> None:
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

        register_trainer(TRAINER_MODE)(_trainer_class())
        patch.on_remove(
            lambda: TRAINER_REGISTRY.pop(TRAINER_MODE, None),  # verl's registry has no public unregister
            f"TRAINER_REGISTRY[{TRAINER_MODE!r}]",
            "registered through register_trainer",
        )

    patch.after_import(TRAINER_MODULE, register, "register the respo-verl trainer once verl has its V1 trainers")


REGISTRATION = Patch("respo-verl trainer (trainer_mode respo_sync)", "verl", "0.9.1", _register)
