"""``python -m respo_verl.main_ppo``: verl's PPO trainer with ``algorithm`` as a config group.

Same run as ``python -m verl.trainer.main_ppo +algorithm=respo ...``; the differences are the primary config
(``configs/respo_trainer.yaml``, where ``algorithm=respo`` is a plain override and the default), checks that refuse a
job before anything starts (kernel hyperparameters, routing replay off Megatron, the layout rules, the CPU preset's
requirements; also under ``--cfg job``), the CPU preset's driver set-up (``+device=cpu``: CPU platform, tiny model kit),
and a preflight that, once Ray is up, checks on every node that this package is importable and its losses are
registered, so that a cluster with a node missing the package stops before any model is loaded. With the respo-verl
trainer (the presets' ``trainer.v1.trainer_mode=respo_sync``), a resume from another run's checkpoint is refused before
Ray starts, and SIGTERM saves a checkpoint at the end of the current step and ends the run with exit 0. A Ray cluster
the driver starts itself is stopped once the driver has ended, however it ended (:mod:`respo_verl.run.reaper`). Both of
verl's trainers run: the V1 trainer (default) and the legacy one (``trainer.use_v1=false``), which has none of the
respo-verl trainer's additions and is refused unless ``run_guard.enable=false`` says so.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from respo_verl import algorithms
from respo_verl.cpu.preset import check_cpu_job, is_cpu_job, prepare_driver
from respo_verl.data.check import DataCheckError
from respo_verl.entry_points import CONFIG_PACKAGE, PRIMARY_CONFIG
from respo_verl.run import launch
from respo_verl.run.jobcheck import Job, MachineCheckError, ModelCheckError, check_job
from respo_verl.run.stops import EXIT_REFUSED

ENTRY = "respo"  # respo_verl.run.compose.ENTRY_CONFIGS key of this entry point


def check(config: DictConfig) -> Job:
    """Every check of a job that needs neither verl nor Ray (ValueError with one line naming the key): the job's own
    (:func:`respo_verl.run.jobcheck.check_job`, the layout rules included), the CPU preset's, the trainer's and the
    resume's. Returns the job's view, made once here."""
    job = check_job(config)
    check_cpu_job(config)
    launch.check_trainer(config)
    launch.check_resume(config)
    return job


def run(config: DictConfig, job: Job) -> None:
    """Run a job that passed :func:`check` (``job``: its view): set up the CPU preset's driver for a CPU job, then
    :func:`respo_verl.run.launch.train`, which checks the loss name against verl's registry before Ray starts."""
    from respo_verl.verl.config import require_policy_loss

    if is_cpu_job(config):
        prepare_driver(config)  # before verl's trainer modules ask for the platform
    launch.train(config, job, check_loss=require_policy_loss)


def _missing_group_option(overrides: list[str]) -> tuple[str, str, list[str]] | None:
    """The first override that selects an option its config group does not have, as (group, option, the group's
    options), looked up in the config folders the job is composed from, without composing it; None when there is
    none, or when Hydra will reject the overrides for another reason (it reports that itself)."""
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.utils import create_config_search_path
    from hydra.core.object_type import ObjectType
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from respo_verl.run.compose import VERL_CONFIG_PACKAGE, package_dir

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return None
    search_path = create_config_search_path(f"pkg://{CONFIG_PACKAGE}")
    search_path.append("verl", f"file://{package_dir(VERL_CONFIG_PACKAGE)}")  # respo_trainer.yaml's search path
    repository = ConfigRepository(search_path)
    for override in parsed:
        group, option = override.key_or_group, override.value()
        if override.is_delete() or not isinstance(option, str) or not repository.group_exists(group):
            continue
        if not repository.config_exists(f"{group}/{option}"):
            return group, option, repository.get_group_options(group, ObjectType.CONFIG)
    return None


def _precheck(argv: list[str]) -> None:
    """Before Hydra runs: exit 2 with one line for an option of a config group that does not exist
    (``algorithm=respoo``, ``+cluster=...``, ``routing=r4``; Hydra's own report is 14-19 lines). Under ``--cfg``/``-c``
    Hydra prints the job without calling the task function, so the job is composed and :func:`check`-ed here; a run
    is composed once, by Hydra, and checked in :func:`_hydra_main`."""
    from hydra._internal.utils import get_args_parser

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        return  # Hydra reports its own usage errors
    missing = _missing_group_option(args.overrides)
    if missing is not None:
        group, option, options = missing
        options = list(algorithms.NAMES) if group == "algorithm" else options
        print(
            f"respo_verl.main_ppo: {group}={option}: no such option of {group} (one of {', '.join(options)})",
            file=sys.stderr,
        )
        sys.exit(EXIT_REFUSED)
    if not args.cfg:
        return
    from respo_verl.run.compose import ComposeError, compose_job

    try:
        config = compose_job(ENTRY, args.overrides)
    except ComposeError:
        return  # Hydra reports the same composition error itself
    _refuse_unless_checked(config)


def _refuse_unless_checked(config: DictConfig) -> Job:
    try:
        return check(config)
    except ValueError as exc:  # a job that cannot run: one line, exit 2, before Ray starts
        print(f"respo_verl.main_ppo: {exc}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)


@hydra.main(config_path=f"pkg://{CONFIG_PACKAGE}", config_name=PRIMARY_CONFIG, version_base=None)
def _hydra_main(config: DictConfig) -> None:
    """Hydra's task: :func:`check` the job Hydra composed, once, then :func:`run` it."""
    job = _refuse_unless_checked(config)
    try:
        run(config, job)
    except (DataCheckError, MachineCheckError, ModelCheckError) as exc:  # raised before Ray starts
        print(f"respo_verl.main_ppo: {exc}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)


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
