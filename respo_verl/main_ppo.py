"""``python -m respo_verl.main_ppo``: verl's PPO trainer with ``algorithm`` as a config group.

Same run as ``python -m verl.trainer.main_ppo +algorithm=respo ...``; the differences are the primary config
(``configs/respo_trainer.yaml``, where ``algorithm=respo`` is a plain override and the default), checks that refuse a
job before anything starts (kernel hyperparameters, routing replay off Megatron, the CPU preset's requirements; also
under ``--cfg job``), the CPU preset's driver set-up (``+device=cpu``: CPU platform, tiny model kit), and a preflight
that, once Ray is up, checks on every node that this package is importable and its losses are registered, so that a
cluster with a node missing the package stops before any model is loaded. Both of verl's trainers run: the V1 trainer
(default) and the legacy one (``trainer.use_v1=false``).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from respo_verl.cpu.preset import check_cpu_job, is_cpu_job, prepare_driver
from respo_verl.entry_points import CONFIG_PACKAGE, PRIMARY_CONFIG
from respo_verl.verl.jobcheck import check_job

ENTRY = "respo"  # respo_verl.verl.compose.ENTRY_CONFIGS key of this entry point


def _with_preflight(runner_cls):
    """A stand-in for a TaskRunner actor class that runs the node preflight right before the runner starts."""
    from respo_verl.verl.preflight import check_ray_nodes

    class _PreflightTaskRunner:
        @staticmethod
        def remote(*args, **kwargs):
            check_ray_nodes()
            return runner_cls.remote(*args, **kwargs)

        @staticmethod
        def options(*args, **kwargs):
            check_ray_nodes()
            return runner_cls.options(*args, **kwargs)

    return _PreflightTaskRunner


def check(config: DictConfig) -> None:
    """Every check of a job that needs neither verl nor Ray (ValueError with one line naming the key)."""
    check_job(config)
    check_cpu_job(config)


def run(config: DictConfig) -> None:
    """Check ``config``, validate it as verl's main_ppo does, then train with verl's V1 or legacy TaskRunner."""
    check(config)
    if is_cpu_job(config):
        prepare_driver(config)  # before verl's trainer modules ask for the platform
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
        run_ppo(config, task_runner_class=_with_preflight(runner_cls))
    finally:
        if ray.is_initialized():
            ray.shutdown()


def _check_printed_job(argv: list[str]) -> None:
    """Under ``--cfg``/``-c``, run :func:`check` on the job Hydra is about to print; exit 2 with one line if it fails.

    Hydra prints the job without calling the task function, so the checks run here, on the same composition.
    """
    from hydra._internal.utils import get_args_parser

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        return  # Hydra reports its own usage errors
    if not args.cfg:
        return
    from respo_verl.verl.compose import ComposeError, compose_job

    try:
        config = compose_job(ENTRY, args.overrides)
    except ComposeError:
        return  # Hydra reports the same composition error itself
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
    run(config)


def main() -> None:
    _check_printed_job(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
