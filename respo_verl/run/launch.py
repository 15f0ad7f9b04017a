"""The steps of a run that come after composition, in the order the entry point takes them.

:func:`check_trainer` and :func:`check_resume` refuse verl's legacy trainer with the guards on, and a resume from
another run's checkpoint or a damaged one. :func:`train` checks the machine, the model and the data before Ray,
validates the job as verl's entry point does, and starts verl's TaskRunner with hooks that run once Ray is up: the
node preflight (:mod:`respo_verl.run.preflight`), the watchdog (:func:`start_watchdog`), the SIGTERM handler (save
at the end of the step, then stop) and the reaper of a Ray cluster the driver started (:mod:`respo_verl.run.reaper`).
"""

from __future__ import annotations

import signal
import sys

from omegaconf import DictConfig, OmegaConf

from respo_verl.data.check import check_data
from respo_verl.run.jobcheck import RESOURCES_KEY, Job, check_machine, check_model, uses_respo_trainer
from respo_verl.run.nodes import lost_node_stop
from respo_verl.run.stops import EXIT_ERROR, EXIT_REFUSED, stop_of

PROG = "respo_verl.main_ppo"  # how the run's own lines name it
_REAPER = None  # the reaper's process (respo_verl.run.reaper), kept for the driver's lifetime
# A file the watchdog appends each phase record it reads to (respo_verl.run.watchdog.Watchdog's trace).
WATCHDOG_TRACE_ENV = "RESPO_VERL_WATCHDOG_TRACE"
_WATCHDOG = None  # the watchdog (respo_verl.run.watchdog.Watchdog) of this driver's run


def with_driver_hooks(runner_cls, job: Job):
    """A stand-in for a TaskRunner actor class that, once Ray is up and right before the runner starts, runs the node
    preflight (:func:`respo_verl.run.preflight.check_ray_nodes`: a failure is exit 2, before any model loads), starts
    the watchdog and installs the SIGTERM handler (here, because ``ray.init`` installs Ray's own, which aborts the
    driver)."""
    import ray

    from respo_verl.run.nodes import shared_folders
    from respo_verl.run.preflight import check_ray_nodes
    from respo_verl.run.requirements import job_requirements

    def _before_start():
        stop_local_ray_with_driver()
        try:
            check_ray_nodes(requirements=job_requirements(job.config), folders=shared_folders(job.config))
        except RuntimeError as exc:  # check_ray_nodes raises RuntimeError only for a failed preflight
            print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_REFUSED) from None
        missing = sorted(set(job.trainer_resources) - set(ray.cluster_resources()))
        if missing:  # the TaskRunner would wait for a node with them for ever
            print(f"{PROG}: {RESOURCES_KEY}: no node of the cluster has {missing}", file=sys.stderr)
            raise SystemExit(EXIT_REFUSED)
        start_watchdog(job)
        stop_on_sigterm()

    class _HookedTaskRunner:
        @staticmethod
        def remote(*args, **kwargs):
            return _HookedTaskRunner.options().remote(*args, **kwargs)

        @staticmethod
        def options(**options):
            _before_start()
            # no resources: Ray's choice (the driver's node if it has room)
            resources = {"resources": job.trainer_resources} if job.trainer_resources else {}
            return runner_cls.options(**resources, **options)

    return _HookedTaskRunner


def stop_local_ray_with_driver():
    """When this driver started its own Ray cluster (``ray.init`` without an address), start the reaper that stops
    that cluster's processes once the driver has ended, SIGKILL included (:mod:`respo_verl.run.reaper`). A cluster
    the job connected to through an address is left alone. Returns the reaper's process, or None."""
    from respo_verl.patches import ray_private
    from respo_verl.run.reaper import watch_driver

    global _REAPER
    node = ray_private.driver_node()
    if node is None or not getattr(node, "ray_init_cluster", False):
        return None
    _REAPER = watch_driver(node.get_session_dir_path())
    return _REAPER


def start_watchdog(job: Job) -> None:
    """With the respo-verl trainer, start the watchdog in this driver (:class:`respo_verl.run.watchdog.Watchdog`),
    with its look at the run's nodes and set-up actors (:class:`respo_verl.run.nodes.ClusterWatch`): on a stall, a
    lost node or an actor failed in the set-up it interrupts the driver's wait for the trainer, and :func:`train`
    prints the stop's line."""
    import _thread
    import os

    from respo_verl.run.nodes import ClusterWatch
    from respo_verl.run.watchdog import PHASE, STOP, Records, Watchdog

    global _WATCHDOG
    if not job.respo_trainer:
        return
    records = Records()
    for name in (PHASE, STOP):  # a record of an earlier driver of this job (a resubmitted Ray job)
        records.delete(name)
    trace = os.environ.get(WATCHDOG_TRACE_ENV)
    _WATCHDOG = Watchdog(records, job.guard, trace=trace, cluster=ClusterWatch.of_this_job())
    interruptible_main()
    _WATCHDOG.start(on_stop=_thread.interrupt_main)


def interruptible_main() -> None:
    """Make ``_thread.interrupt_main`` (the watchdog's stop) raise KeyboardInterrupt in this process's main thread:
    it does so only where SIGINT has a Python handler, and a process started in the background by a non-interactive
    shell (``nohup``, ``cmd &``) inherits SIGINT ignored. Such a SIGINT gets Python's own handler back."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_on_sigterm() -> None:
    """Turn SIGTERM (Slurm's ``--signal``, a Kubernetes eviction) into a request to save and stop: with the watchdog
    started, it carries the request to the trainer, which saves at the end of its step and ends the run (exit 0).
    Any other trainer keeps Python's default (the process ends at once)."""
    if _WATCHDOG is None:
        return

    def _request_stop(signum, frame):
        _WATCHDOG.request_stop()
        print(
            f"{PROG}: {signal.Signals(signum).name}: the trainer saves at the end of this step and stops, or ends "
            "without saving if the step makes no progress for run_guard.max_stall_after_stop_s; send SIGKILL to end "
            "at once",
            file=sys.stderr,
            flush=True,
        )

    signal.signal(signal.SIGTERM, _request_stop)


def check_resume(config: DictConfig) -> None:
    """With the respo-verl trainer, refuse a resume from another run's checkpoint before Ray starts (the trainer
    checks again when it loads; :func:`respo_verl.checkpoint.plan_resume`)."""
    if uses_respo_trainer(config):
        from respo_verl.checkpoint import plan_resume

        plan_resume(config)


def check_trainer(config: DictConfig) -> None:
    """Refuse verl's legacy trainer while the run guards are on: none of the respo-verl trainer's additions apply to
    it (verl 0.9.1 deprecates it too), so a run would silently go without them."""
    if not OmegaConf.select(config, "trainer.use_v1", default=True) and OmegaConf.select(
        config, "run_guard.enable", default=False
    ):
        raise ValueError(
            "trainer.use_v1=false: verl's legacy trainer has none of the respo-verl trainer's checkpoint fingerprints, "
            "SIGTERM save-and-stop, appending log and run guards; drop the override (the V1 trainer is the default), "
            "or add run_guard.enable=false to run the legacy trainer without them"
        )


def train(config: DictConfig, job: Job, check_loss=None) -> None:
    """Check the machine, the model and the data, validate ``config`` as verl's main_ppo does, then train with verl's
    V1 or legacy TaskRunner, its hooks reading ``job``, the view the job's check made of it
    (:class:`respo_verl.run.jobcheck.Job`). ``check_loss``, when given, is called with the job's
    ``policy_loss.loss_mode`` once verl is imported, before the validation (the entry point passes the glue's
    :func:`respo_verl.verl.config.require_policy_loss`). Raises the checks' errors (DataCheckError,
    MachineCheckError, ModelCheckError) before Ray starts. A run that stops prints one line naming the cause
    (:func:`respo_verl.run.stops.stop_of`) on stderr, and nothing of Ray's after it (:func:`end_ray_echo`), and exits
    with its status (``SystemExit``); an error the run does not know is re-raised after its line (exit 1, with its
    traceback)."""
    check_machine(config)  # before Ray: a cuda job on a machine without CUDA, with a Ray of its own
    check_model(config)  # before Ray: a model path that is not there
    check_data(config)  # before Ray: rows verl would otherwise train on silently
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    if check_loss is not None:
        check_loss(config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla"))
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if config.trainer.use_v1:
        runner_cls = TaskRunnerV1
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner as runner_cls
    hooked_runner_cls = with_driver_hooks(runner_cls, job)
    global _WATCHDOG
    try:
        run_ppo(config, task_runner_class=hooked_runner_cls)
    except (KeyboardInterrupt, Exception) as exc:  # the watchdog interrupts the wait for the trainer (as Ctrl-C does)
        stopped = _WATCHDOG.stopped if _WATCHDOG is not None else None
        if isinstance(exc, KeyboardInterrupt) and stopped is None:
            raise
        # Ray re-raises the trainer's stop wrapped in a traceback per process: its line instead; a Ray actor error
        # because a node went away names the node, its roles and the step (respo_verl.run.nodes), the step as the
        # trainer's record holds it then
        step = _WATCHDOG.latest_step if _WATCHDOG is not None else None
        stop = stop_of(stopped or lost_node_stop(exc, step) or exc, PROG)
        end_ray_echo()
        print(stop.line, file=sys.stderr, flush=True)
        if stop.status == EXIT_ERROR:
            raise
        raise SystemExit(stop.status) from None
    finally:
        if _WATCHDOG is not None:
            _WATCHDOG.close()
            _WATCHDOG = None
        if ray.is_initialized():
            ray.shutdown()


def end_ray_echo() -> None:
    """From here on the driver's console gets none of what Ray echoes of its workers' logs and errors (its log folder
    keeps them): the logs of a dying job's actors, lagging behind, would follow the stop's line, tracebacks included.
    The switch is the one Ray's own debugger turns (``ray.util.rpdb``)."""
    from respo_verl.patches import ray_private

    ray_private.stop_log_echo()
