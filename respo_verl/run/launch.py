"""The steps of a run that come after composition, in the order the entry point takes them.

:func:`check_trainer` and :func:`check_resume` refuse, before anything starts, verl's legacy trainer with the
guards on and a resume from another run's checkpoint or from a damaged one (the job's own checks are
:mod:`respo_verl.run.jobcheck`'s). :func:`train` checks the machine, the model and the data before Ray, validates the
job as verl's own entry point does, and starts verl's TaskRunner with three hooks that run once Ray is up: the node
preflight (:mod:`respo_verl.run.preflight`), the SIGTERM handler (save at the end of the step, then stop) and the
watchdog's phase deadline (:func:`watch_phases`). A Ray cluster the driver starts itself is stopped once the driver
has ended, however it ended (:mod:`respo_verl.run.reaper`).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from omegaconf import DictConfig

from respo_verl.run.datacheck import check_data
from respo_verl.run.jobcheck import check_machine, check_model
from respo_verl.run.stops import EXIT_ERROR, EXIT_REFUSED, stop_of

PROG = "respo_verl.main_ppo"  # how the run's own lines name it
_REAPER = None  # the reaper's process (respo_verl.run.reaper), kept for the driver's lifetime
_PHASE_DEADLINE = None  # the watchdog's phase deadline (respo_verl.run.watchdog.PhaseDeadline) of this driver's run


def with_driver_hooks(runner_cls, config: DictConfig):
    """A stand-in for a TaskRunner actor class that, once Ray is up and right before the runner starts, runs the node
    preflight and installs the SIGTERM handler (:func:`stop_on_sigterm`; here, because ``ray.init`` installs Ray's
    own handler, which aborts the driver).

    The preflight checks on every node that this package is registered there and that what the job needs
    (:func:`respo_verl.run.requirements.job_requirements`: rollout engine, Megatron stack, DeepEP, CUDA GPUs)
    imports there; a failure ends the run with exit 2 and one line per missing piece, before any model is loaded.
    """
    from respo_verl.run.preflight import check_ray_nodes
    from respo_verl.run.requirements import job_requirements

    def _before_start():
        stop_local_ray_with_driver()
        try:
            check_ray_nodes(requirements=job_requirements(config))
        except RuntimeError as exc:  # check_ray_nodes raises RuntimeError only for a failed preflight
            print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_REFUSED) from None
        stop_on_sigterm(config)
        watch_phases(config)

    class _HookedTaskRunner:
        @staticmethod
        def remote(*args, **kwargs):
            _before_start()
            return runner_cls.remote(*args, **kwargs)

        @staticmethod
        def options(*args, **kwargs):
            _before_start()
            return runner_cls.options(*args, **kwargs)

    return _HookedTaskRunner


def stop_local_ray_with_driver():
    """When this driver started its own Ray cluster (``ray.init`` without an address), start the reaper that stops
    that cluster's processes once the driver has ended, SIGKILL included (:mod:`respo_verl.run.reaper`). A cluster
    the job connected to through an address is left alone. Returns the reaper's process, or None."""
    import ray._private.worker as ray_worker

    from respo_verl.run.reaper import watch_driver

    global _REAPER
    node = getattr(ray_worker, "_global_node", None)
    if node is None or not getattr(node, "ray_init_cluster", False):
        return None
    _REAPER = watch_driver(node.get_session_dir_path())
    return _REAPER


def watch_phases(config: DictConfig):
    """With the respo-verl trainer and its guards on, start the watchdog's phase deadline in this driver
    (:class:`respo_verl.run.watchdog.PhaseDeadline`): it reads the trainer's phase record every 2 s and, when a
    phase has made no progress for ``run_guard.max_phase_s``, interrupts the driver's wait for the trainer; the
    entry point then prints the stop's line and exits with its status. A record left by an earlier attempt is
    removed first. Returns the deadline, or None."""
    import _thread

    from respo_verl.run import checkpoint
    from respo_verl.run.guards import GuardConfig
    from respo_verl.run.watchdog import PhaseDeadline, phase_file

    global _PHASE_DEADLINE
    guard = GuardConfig.from_config(config.get("run_guard"))
    if not uses_respo_trainer(config) or not guard.enable:
        return None
    path = phase_file(checkpoint.checkpoint_folder(config))
    path.unlink(missing_ok=True)
    _PHASE_DEADLINE = PhaseDeadline(path, guard)
    interruptible_main()
    _PHASE_DEADLINE.start(on_stop=_thread.interrupt_main)
    return _PHASE_DEADLINE


def interruptible_main() -> None:
    """Make ``_thread.interrupt_main`` raise KeyboardInterrupt in this process's main thread.

    It does so only where SIGINT has a Python handler, and a process started in the background by a non-interactive
    shell (``nohup``, ``cmd &``, many batch scripts) inherits SIGINT ignored: Python then installs none, and the
    phase deadline's interrupt did nothing (a driver so started sat in a hung weight sync past every bound). A SIGINT
    that is ignored or left to the system gets Python's own handler back.
    """
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_on_sigterm(config: DictConfig) -> Path | None:
    """Turn SIGTERM (Slurm's ``--signal``, a Kubernetes eviction) into a request to save and stop.

    With the respo-verl trainer (``trainer.use_v1``, ``trainer.v1.trainer_mode=respo_sync``), the handler writes the
    run's stop request (:func:`respo_verl.run.checkpoint.stop_request`); the trainer, in its Ray actor, saves a
    checkpoint at the end of the step it is in and ends the run, and this process exits 0. A stale request of an
    earlier attempt is removed first. Any other trainer keeps Python's default (the process ends at once). Returns
    the request's path, or None when the handler was not installed.
    """
    from respo_verl.run import checkpoint

    if not uses_respo_trainer(config):
        return None
    request = checkpoint.stop_request(config)
    request.unlink(missing_ok=True)

    def _request_stop(signum, frame):
        request.parent.mkdir(parents=True, exist_ok=True)
        request.touch()
        if _PHASE_DEADLINE is not None:
            _PHASE_DEADLINE.request_stop()
        print(
            f"{PROG}: {signal.Signals(signum).name}: the trainer saves at the end of this step and "
            f"stops ({request}), or ends without saving if the step makes no progress for "
            "run_guard.max_stall_after_stop_s; send SIGKILL to end at once",
            file=sys.stderr,
            flush=True,
        )

    signal.signal(signal.SIGTERM, _request_stop)
    return request


def uses_respo_trainer(config: DictConfig) -> bool:
    from omegaconf import OmegaConf

    from respo_verl.run.trainer import TRAINER_MODE

    use_v1 = config.get("trainer", {}).get("use_v1", True)
    return bool(use_v1) and OmegaConf.select(config, "trainer.v1.trainer_mode") == TRAINER_MODE


def check_resume(config: DictConfig) -> None:
    """With the respo-verl trainer, refuse a resume from another run's checkpoint before Ray starts (the trainer
    checks again when it loads; :func:`respo_verl.run.checkpoint.plan_resume`)."""
    if uses_respo_trainer(config):
        from respo_verl.run.checkpoint import plan_resume

        plan_resume(config)


def check_trainer(config: DictConfig) -> None:
    """Refuse verl's legacy trainer while the run guards are on: none of the respo-verl trainer's additions apply to
    it (verl 0.9.1 deprecates it too), so a run would silently go without them."""
    from omegaconf import OmegaConf

    if not OmegaConf.select(config, "trainer.use_v1", default=True) and OmegaConf.select(
        config, "run_guard.enable", default=False
    ):
        raise ValueError(
            "trainer.use_v1=false: verl's legacy trainer has none of the respo-verl trainer's checkpoint fingerprints, "
            "SIGTERM save-and-stop, appending log and run guards; drop the override (the V1 trainer is the default), "
            "or add run_guard.enable=false to run the legacy trainer without them"
        )


def train(config: DictConfig, check_loss=None) -> None:
    """Check the machine, the model and the data, validate ``config`` as verl's main_ppo does, then train with verl's
    V1 or legacy TaskRunner. ``check_loss``, when given, is called with the job's ``policy_loss.loss_mode`` once verl
    is imported, before the validation (the entry point passes the glue's
    :func:`respo_verl.verl.config.require_policy_loss`). Raises the checks' errors (DataCheckError,
    MachineCheckError, ModelCheckError) before Ray starts. A run that stops prints one line naming the cause
    (:func:`respo_verl.run.stops.stop_of`) on stderr before anything else of the stop, and exits with its status
    (``SystemExit``); an error the run does not know is re-raised after its line (exit 1, with its traceback)."""
    check_machine(config)  # before Ray: a cuda job on a machine without CUDA, with a Ray of its own
    check_model(config)  # before Ray: a model path that is not there, routing replay on a dense model
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
    global _PHASE_DEADLINE
    try:
        run_ppo(config, task_runner_class=with_driver_hooks(runner_cls, config))
    except KeyboardInterrupt:  # the phase deadline interrupts the wait for the trainer (or a Ctrl-C does)
        stopped = _PHASE_DEADLINE.stopped if _PHASE_DEADLINE is not None else None
        if stopped is None:
            raise
        stop = stop_of(stopped, PROG)
        print(stop.line, file=sys.stderr, flush=True)
        raise SystemExit(stop.status) from None
    except Exception as exc:  # Ray re-raises the trainer's stop wrapped in a traceback per process: its line first
        stop = stop_of(exc, PROG)
        print(stop.line, file=sys.stderr, flush=True)
        if stop.status == EXIT_ERROR:
            raise
        raise SystemExit(stop.status) from None
    finally:
        if _PHASE_DEADLINE is not None:
            _PHASE_DEADLINE.close()
            _PHASE_DEADLINE = None
        if ray.is_initialized():
            ray.shutdown()
