"""The respo-verl trainer class: verl 0.9.1's ``PPOTrainerSync`` with the additions of
docs/internals.md, "The respo-verl trainer and its checkpoints"; every stop is a
:class:`respo_verl.run.stops.RunStopped`. Imports verl: only the registration
(:data:`respo_verl.run.trainer.REGISTRATION`) imports this module, once verl has imported its V1 trainers.

What it overrides of verl 0.9.1 (read against ``verl/trainer/ppo/v1/trainer_base.py`` and ``trainer_sync.py`` of
verl 0.9.1), public hooks first:

- ``init``, ``on_init_end``, ``on_train_begin``, ``on_step_begin``, ``on_step_end``, ``on_validate_begin``,
  ``on_validate_end``, ``fit``: the phase record (the set-up's stages too), the hooks on verl's logger and replay
  buffer, the stop request;
- ``_fetch_one_gen_batch``: the data loader's order of the prompts (:func:`respo_verl.run.hooks.in_prompt_order`);
- ``_load_checkpoint``: the resume plan (:func:`respo_verl.checkpoint.plan_resume`), a stage of the set-up;
- ``_save_checkpoint``: the phase of the save and the checkpoint's marker;
- ``_compute_metrics``: the run guards on the step's metrics;
- ``_compute_advantage``: non-finite rewards named with their step.

The other phases of a step are the ones verl times (``marked_timer``: generation, reward, old log-probs, ...):
:func:`respo_verl.run.hooks.phase_timers` records them, so that no private method is overridden only to wrap a phase.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

from omegaconf import open_dict
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from respo_verl import checkpoint
from respo_verl.patches import Patch, verl_0_9_1
from respo_verl.run.guards import EVICTED_GROUPS_KEY, STOPPED_KEY, StepGuards, failed_sample_metrics
from respo_verl.run.hooks import in_prompt_order, phase_timers, trainer_hooks
from respo_verl.run.jobcheck import Job
from respo_verl.run.liveness import SampleWait, await_created, watch_replay_buffer, watched_actors
from respo_verl.run.liveness import waits_on as count_actors
from respo_verl.run.nodes import record_placement
from respo_verl.run.roles import (
    CRITIC_WORKER,
    GENERATION_ACTORS,
    ROLLOUT_SERVER,
    TIMED_PHASES,
    UPDATE_WORKER,
    VALIDATION,
)
from respo_verl.run.stops import NonFinite, RunStopped, stop_for_error
from respo_verl.run.watchdog import STOP, PhaseBoard, Records, setup_phase

logger = logging.getLogger(__name__)

# Popped by verl's loop before it logs a step: a table for its own logger, not a metric.
DAPO_COUNTS_KEY = "_dapo_filtered_reward_counts"
# What a stage of the set-up waits on before its worker groups exist: the driver counts the actors verl creates.
SETUP_WAITS = "the trainer (TaskRunner) and the actors verl creates for it"
AGENT_LOOP_STAGE = "the agent loop"


class RespoTrainer(PPOTrainerSync):
    """verl's ``PPOTrainerSync`` with the additions the module docstring lists."""

    def __init__(self, config, *args, **kwargs):
        job = Job.of(config)  # the TaskRunner's view of the job, made once
        self._guards = StepGuards(job.guard, job.replay)
        # The run's identity before verl adds its own keys (optimizer step counts, TransferQueue) to the config.
        self._run = checkpoint.identity(config)
        self._records = Records()
        # The phase of the step, and the stage of the set-up, for the driver's watchdog (respo_verl.run.watchdog).
        self._board = PhaseBoard(self._records if job.guard.enable else None)
        self._setup_stage("the trainer: its replay buffer")
        self._prompt_order: dict[str, int] = {}  # uid -> position, for the train prompts not yet sampled
        self._prompts_fetched = 0
        self._sample_wait: SampleWait | None = None
        self._patches: list[Patch] = []
        self._saved_step: int | None = None  # the step whose checkpoint this attempt saved last
        self._unmarked_step: int | None = None  # a saved step whose line is not logged yet
        self._stopping = False  # a guard stops the run in this step
        verl_0_9_1.FILE_LOGGER_APPEND.apply()
        super().__init__(config, *args, **kwargs)

    def _phase(self, phase: str, *kinds: str, folder: Path | None = None):
        return self._board.phase(self.global_steps, phase, count_actors(self, *kinds), folder and str(folder))

    def _timed_phase(self, name: str):
        timed = TIMED_PHASES.get(name)
        return self._phase(timed[0], *timed[1]) if timed else nullcontext()

    def _setup_stage(self, stage: str, waits_on: str = SETUP_WAITS) -> None:
        self._board.enter(getattr(self, "global_steps", 0), setup_phase(stage), waits_on)

    def init(self):
        self._setup_stage("workers, rollout servers, reward loop")
        super().init()

    def on_init_end(self):
        self._setup_stage("the first weight sync", count_actors(self, UPDATE_WORKER, ROLLOUT_SERVER))
        super().on_init_end()
        # then verl's TaskRunner builds the agent loop, whose workers nothing calls before the first step
        self._setup_stage(AGENT_LOOP_STAGE)

    def on_validate_begin(self):
        self._board.enter(self.global_steps, VALIDATION, count_actors(self, *GENERATION_ACTORS))
        super().on_validate_begin()

    def on_validate_end(self):
        super().on_validate_end()
        self._board.enter(self.global_steps, "between phases, after validation", count_actors(self))

    def _fetch_one_gen_batch(self):
        batch = super()._fetch_one_gen_batch()
        for uid in batch["uid"]:
            self._prompt_order[str(uid)] = self._prompts_fetched
            self._prompts_fetched += 1
        return batch

    def _load_checkpoint(self):
        self._setup_stage("the checkpoint's load", count_actors(self, UPDATE_WORKER, CRITIC_WORKER))
        plan = checkpoint.plan_resume(self.config, run=self._run)
        for line in plan.warnings:
            logger.warning("respo-verl: %s", line)
            print(f"respo-verl: WARNING: {line}", flush=True)
        if plan.resume_from is None or self.config.trainer.resume_mode != "auto":
            return super()._load_checkpoint()
        with open_dict(self.config.trainer):
            self.config.trainer.resume_mode = "resume_path"
            self.config.trainer.resume_from_path = str(plan.resume_from)
        try:
            return super()._load_checkpoint()
        finally:
            with open_dict(self.config.trainer):
                self.config.trainer.resume_mode = "auto"

    def on_train_begin(self):
        super().on_train_begin()
        record_placement()  # one line per role with its node: the record a lost node's stop line reads
        # verl's Tracking and ReplayBuffer, built by fit() before this hook.
        self._patches = [
            trainer_hooks(self.logger, self._mark_saved_step, self.replay_buffer, self._in_prompt_order),
            phase_timers(self._timed_phase),
        ]
        if self._guards.config.enable:  # the actors' liveness and the samples' progress while a step waits
            self._sample_wait = SampleWait(watched_actors(self), self._board)
            self._sample_wait.begin(self.global_steps)
            self._patches.append(watch_replay_buffer(self.replay_buffer, self._sample_wait))
        for patch in self._patches:
            patch.apply()

    def on_step_begin(self):
        super().on_step_begin()
        if self._sample_wait is not None:
            self._sample_wait.begin(self.global_steps)

    def fit(self, agent_loop_manager, *args, **kwargs):
        # the set-up ends once the actors the first step calls exist: one that failed stops the run here, named
        self.agent_loop_manager = agent_loop_manager
        await_created(watched_actors(self), setup_phase(AGENT_LOOP_STAGE))
        try:
            return super().fit(agent_loop_manager, *args, **kwargs)
        except RunStopped:
            raise
        except Exception as exc:  # a dead actor the step called, non-finite values: one line naming the step
            stop = stop_for_error(exc, self.global_steps)
            if stop is None:
                raise
            raise stop from None
        finally:
            self._board.pause("training ended")
            for patch in reversed(self._patches):
                patch.remove()

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
        with self._phase("save", UPDATE_WORKER, CRITIC_WORKER, folder=folder):
            super()._save_checkpoint()
        self._saved_step = self.global_steps
        # verl logs the step's metrics after its save (and after validation): the marker waits for that line, so
        # that a run killed in between redoes the step from the checkpoint before instead of losing its line.
        self._unmarked_step = self.global_steps

    def _mark_saved_step(self, step) -> None:
        if step is None or self._unmarked_step != step or self._stopping:
            return  # a step a guard stopped in is not a step to resume after
        folder = Path(checkpoint.checkpoint_folder(self.config)) / f"global_step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        # every file the save wrote, for the check before a resume (a few reads per file: seconds)
        files = checkpoint.manifest(folder)
        checkpoint.write_marker_info(folder, {**self._run, "step": int(step), "files": files})
        self._unmarked_step = None

    def on_step_end(self):
        super().on_step_end()  # verl: the rollout servers load the updated weights (a timed phase)
        request = self._records.get(STOP)
        if request is not None and self.global_steps < self.total_training_steps:
            if self._saved_step != self.global_steps:
                self._save_checkpoint()
            print(
                f"respo-verl: stop requested ({request.get('signal')} to the driver): saved "
                f"global_step_{self.global_steps}, ending the run",
                flush=True,
            )
            self._records.delete(STOP)
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


# The registration (respo_verl.run.trainer) ran while this module was being imported (the import of verl's trainer
# above triggers it): it left here the step that registers the class.
if "register_when_defined" in globals():
    globals().pop("register_when_defined")(RespoTrainer)
