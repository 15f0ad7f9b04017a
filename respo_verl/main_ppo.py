"""``python -m respo_verl.main_ppo``: verl's PPO trainer with ``algorithm`` as a config group.

Same run as ``python -m verl.trainer.main_ppo +algorithm=respo ...``; the differences are the primary config
(``configs/respo_trainer.yaml``, where ``algorithm=respo`` is a plain override and the default), checks that refuse a
job before anything starts (kernel hyperparameters, routing replay off Megatron, the CPU preset's requirements; also
under ``--cfg job``), the CPU preset's driver set-up (``+device=cpu``: CPU platform, tiny model kit), and a preflight
that, once Ray is up, checks on every node that this package is importable and its losses are registered, so that a
cluster with a node missing the package stops before any model is loaded. With the respo-verl trainer (the presets'
``trainer.v1.trainer_mode=respo_sync``), a resume from another run's checkpoint is refused before Ray starts, and
SIGTERM saves a checkpoint at the end of the current step and ends the run with exit 0. A Ray cluster the driver
starts itself is stopped once the driver has ended, however it ended (:mod:`respo_verl.verl.reaper`). Both of verl's
trainers run: the V1 trainer (default) and the legacy one (``trainer.use_v1=false``), which has none of the
respo-verl trainer's additions and is refused unless ``run_guard.enable=false`` says so.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from respo_verl import algorithms
from respo_verl.cpu.preset import check_cpu_job, is_cpu_job, prepare_driver
from respo_verl.entry_points import CONFIG_PACKAGE, PRIMARY_CONFIG
from respo_verl.verl.datacheck import DataCheckError, check_data
from respo_verl.verl.jobcheck import MachineCheckError, ModelCheckError, check_job, check_machine, check_model

ENTRY = "respo"  # respo_verl.verl.compose.ENTRY_CONFIGS key of this entry point
_WATCHDOG = None  # the reaper's process (respo_verl.verl.reaper), kept for the driver's lifetime


def _with_driver_hooks(runner_cls, config: DictConfig):
    """A stand-in for a TaskRunner actor class that, once Ray is up and right before the runner starts, runs the node
    preflight and installs the SIGTERM handler (:func:`_stop_on_sigterm`; here, because ``ray.init`` installs Ray's
    own handler, which aborts the driver).

    The preflight checks on every node that this package is registered there and that what the job needs
    (:func:`respo_verl.verl.requirements.job_requirements`: rollout engine, Megatron stack, DeepEP, CUDA GPUs)
    imports there; a failure ends the run with exit 2 and one line per missing piece, before any model is loaded.
    """
    from respo_verl.verl.preflight import check_ray_nodes
    from respo_verl.verl.requirements import job_requirements

    def _before_start():
        _stop_local_ray_with_driver()
        try:
            check_ray_nodes(requirements=job_requirements(config))
        except RuntimeError as exc:  # check_ray_nodes raises RuntimeError only for a failed preflight
            print(f"respo_verl.main_ppo: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        _stop_on_sigterm(config)

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


def _stop_local_ray_with_driver():
    """When this driver started its own Ray cluster (``ray.init`` without an address), start the watchdog that stops
    that cluster's processes once the driver has ended, SIGKILL included (:mod:`respo_verl.verl.reaper`). A cluster
    the job connected to through an address is left alone. Returns the watchdog's process, or None."""
    import ray._private.worker as ray_worker

    from respo_verl.verl.reaper import watch_driver

    global _WATCHDOG
    node = getattr(ray_worker, "_global_node", None)
    if node is None or not getattr(node, "ray_init_cluster", False):
        return None
    _WATCHDOG = watch_driver(node.get_session_dir_path())
    return _WATCHDOG


def _stop_on_sigterm(config: DictConfig) -> Path | None:
    """Turn SIGTERM (Slurm's ``--signal``, a Kubernetes eviction) into a request to save and stop.

    With the respo-verl trainer (``trainer.use_v1``, ``trainer.v1.trainer_mode=respo_sync``), the handler writes the
    run's stop request (:func:`respo_verl.verl.checkpoint.stop_request`); the trainer, in its Ray actor, saves a
    checkpoint at the end of the step it is in and ends the run, and this process exits 0. A stale request of an
    earlier attempt is removed first. Any other trainer keeps Python's default (the process ends at once). Returns
    the request's path, or None when the handler was not installed.
    """
    from respo_verl.verl import checkpoint

    if not _uses_respo_trainer(config):
        return None
    request = checkpoint.stop_request(config)
    request.unlink(missing_ok=True)

    def _request_stop(signum, frame):
        request.parent.mkdir(parents=True, exist_ok=True)
        request.touch()
        print(
            f"respo_verl.main_ppo: {signal.Signals(signum).name}: the trainer saves at the end of this step and "
            f"stops ({request}); send SIGKILL to end at once",
            file=sys.stderr,
            flush=True,
        )

    signal.signal(signal.SIGTERM, _request_stop)
    return request


def _uses_respo_trainer(config: DictConfig) -> bool:
    from omegaconf import OmegaConf

    from respo_verl.verl.trainer import TRAINER_MODE

    use_v1 = config.get("trainer", {}).get("use_v1", True)
    return bool(use_v1) and OmegaConf.select(config, "trainer.v1.trainer_mode") == TRAINER_MODE


def check_resume(config: DictConfig) -> None:
    """With the respo-verl trainer, refuse a resume from another run's checkpoint before Ray starts (the trainer
    checks again when it loads; :func:`respo_verl.verl.checkpoint.plan_resume`)."""
    if _uses_respo_trainer(config):
        from respo_verl.verl.checkpoint import plan_resume

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


def check(config: DictConfig) -> None:
    """Every check of a job that needs neither verl nor Ray (ValueError with one line naming the key)."""
    check_job(config)
    check_cpu_job(config)
    check_trainer(config)
    check_resume(config)


def run(config: DictConfig) -> None:
    """Check ``config``, validate it as verl's main_ppo does, then train with verl's V1 or legacy TaskRunner."""
    check(config)
    if is_cpu_job(config):
        prepare_driver(config)  # before verl's trainer modules ask for the platform
    check_machine(config)  # before Ray: a cuda job on a machine without CUDA, with a Ray of its own
    check_model(config)  # before Ray: a model path that is not there, routing replay on a dense model
    check_data(config)  # before Ray: rows verl would otherwise train on silently
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    from respo_verl.verl.plugin import require_policy_loss

    auto_set_device(config)
    require_policy_loss(config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla"))
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if config.trainer.use_v1:
        runner_cls = TaskRunnerV1
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner as runner_cls
    try:
        run_ppo(config, task_runner_class=_with_driver_hooks(runner_cls, config))
    finally:
        if ray.is_initialized():
            ray.shutdown()


def _precheck(argv: list[str]) -> None:
    """Before Hydra runs: compose the job once and exit 2 with one line for an option of a config group that does not
    exist (``algorithm=respoo``, ``+cluster=...``, ``routing=r4``); under ``--cfg``/``-c``, also run :func:`check` on
    the job Hydra is about to print (Hydra prints it without calling the task function)."""
    from hydra._internal.utils import get_args_parser

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        return  # Hydra reports its own usage errors
    from hydra.errors import MissingConfigException

    from respo_verl.verl.compose import ComposeError, compose_job

    try:
        config = compose_job(ENTRY, args.overrides)
    except ComposeError as exc:
        missing = exc.hydra_error if isinstance(exc.hydra_error, MissingConfigException) else None
        if missing is None or not getattr(missing, "missing_cfg_file", None):
            return  # Hydra reports the same composition error itself
        group, _, option = missing.missing_cfg_file.rpartition("/")
        options = list(algorithms.NAMES) if group == "algorithm" else list(missing.options or [])
        print(
            f"respo_verl.main_ppo: {group}={option}: no such option of {group} (one of {', '.join(options)})",
            file=sys.stderr,
        )
        sys.exit(2)
    if not args.cfg:
        return
    try:
        check(config)
    except ValueError as exc:
        print(f"respo_verl.main_ppo: {exc}", file=sys.stderr)
        sys.exit(2)


@hydra.main(config_path=f"pkg://{CONFIG_PACKAGE}", config_name=PRIMARY_CONFIG, version_base=None)
def _hydra_main(config: DictConfig) -> None:
    try:
        check(config)
    except ValueError as exc:  # a job that cannot run: one line, before Ray starts
        print(f"respo_verl.main_ppo: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        run(config)
    except (DataCheckError, MachineCheckError, ModelCheckError) as exc:  # raised before Ray starts
        print(f"respo_verl.main_ppo: {exc}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """The command line ``python -m respo_verl.main_ppo ARGV...``; ``argv`` defaults to ``sys.argv[1:]``.

    Hydra reads ``sys.argv`` itself, so a given ``argv`` stands in for it until the run ends (tests call the entry
    point in-process this way to check the refusals that come before Ray).
    """
    if argv is None:
        _precheck(sys.argv[1:])
        _hydra_main()
        return
    saved = sys.argv
    sys.argv = [saved[0] if saved else "respo_verl.main_ppo", *argv]
    try:
        main()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
