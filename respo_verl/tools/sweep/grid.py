"""Expansion of a comparison grid into verl runs sharing one base configuration (the protocol: docs/method.md,
"Published protocol").

N is realised as the paper does: ``data.train_batch_size = ppo_mini_batch_size × N`` prompts, one PPO epoch, and
``trainer.total_training_steps = optimizer_steps / N`` so that every run makes the same number of optimizer updates
(1024 in the paper). Runs differ only in the swept keys.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from respo_verl import checkpoint
from respo_verl.algorithms import ALGORITHMS
from respo_verl.protocol import PAPER_MINI_BATCH, PAPER_OPTIMIZER_STEPS, PAPER_REUSE, PAPER_SEEDS
from respo_verl.routing.mode import REPLAY_MODES
from respo_verl.run import resolvers
from respo_verl.run.compose import ComposeError, compose_job
from respo_verl.tools.runs.manifest import RunRecord, check_name

ENTRY_MODULES = {"respo": "respo_verl.main_ppo", "verl": "verl.trainer.main_ppo"}  # python -m <module>
# The interpreter of a run's command: the cluster's ``python``, so that a printed line can be pasted there (a local
# run substitutes this machine's interpreter, runner.local_command).
PYTHON = "python"
# The verl keys a seed sets, as examples/run_*.sh set them (scripts/launch/launch_common.sh): the prompt order, the
# rollout sampler, and the actor engine's own seed, whose key depends on the engine (model_engine).
SEED_KEYS = ("data.seed", "actor_rollout_ref.rollout.seed")
ENGINE_SEED_KEYS = {
    "dp": "actor_rollout_ref.actor.fsdp_config.seed",
    "megatron": "actor_rollout_ref.actor.megatron.seed",
    "torchtitan": "actor_rollout_ref.actor.torchtitan.seed",
    "veomni": "actor_rollout_ref.actor.veomni.seed",
}
# The run's own checkpoint folder, <checkpoint root>/<run name>: verl's resume_mode=auto resumes from whatever is
# in it, so no two runs may share one (verl's default, checkpoints/<project>/<experiment>, is relative to the
# directory a run is started in).
CHECKPOINT_KEY = "trainer.default_local_dir"
# The key of a run's trackers, verl's ``Tracking`` backends (see run_loggers).
LOGGER_KEY = "trainer.logger"
# verl 0.9.1's tracking backends (verl.utils.tracking.Tracking.supported_backend; a test checks the installed verl's).
VERL_LOGGERS = (
    "console", "file", "wandb", "tensorboard", "mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio", "rl_insight",
)  # fmt: skip
# The logger ``respo-verl report`` reads (verl's file log, at the run's VERL_FILE_LOGGER_PATH): added to every run's.
REPORT_LOGGER = "file"
# verl's own default logger, a run's when neither --logger nor a trainer.logger override names any.
DEFAULT_LOGGERS = ("console",)
# The value of LOGGER_KEY that the configuration hash sees, whatever a run's trackers: a tracker is not part of a
# run's identity, so the same sweep with other trackers keeps its hash (and a manifest whose runs had exactly these
# loggers keeps the hash it recorded).
HASHED_LOGGERS = ["console", "file"]
# Dropped, with the run name, from the configuration hash.
PER_RUN_KEYS = (*SEED_KEYS, *ENGINE_SEED_KEYS.values(), "trainer.experiment_name", CHECKPOINT_KEY)
# The keys N sets (see run_overrides).
REUSE_KEYS = ("data.train_batch_size", "trainer.total_training_steps")
# The keys every run's own overrides set after the shared ones, with what sets them: Hydra keeps the last value, so
# the same key among the shared overrides would be dropped without a word; it is refused instead.
SWEPT_KEYS = {
    "algorithm": "--algos",
    "data.train_batch_size": "--mini-batch x N",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "--mini-batch",
    "actor_rollout_ref.actor.ppo_epochs": "one epoch per rollout batch, the protocol's",
    "trainer.total_training_steps": "--optimizer-steps / N",
    "trainer.project_name": "--project",
    "trainer.experiment_name": "the run's name",
    **{key: "--seeds" for key in (*SEED_KEYS, *ENGINE_SEED_KEYS.values())},
}


class SweepError(ValueError):
    """A run whose job does not compose or does not pass :func:`respo_verl.run.jobcheck.check_job` (one line)."""


@dataclass
class SweepSpec:
    """A grid of runs.

    Attributes:
        algorithms, reuse, seeds: the swept values.
        model: a short model tag for run names (e.g. ``qwen3-30b-a3b``).
        preset: cluster preset (``+cluster=<preset>``), or None.
        routing: routing preset (``routing=<mode>``), or None.
        entry: ``respo`` (python -m respo_verl.main_ppo) or ``verl`` (python -m verl.trainer.main_ppo).
        mini_batch: prompts per optimizer update.
        optimizer_steps: optimizer updates per run; must be a multiple of every N.
        base_overrides: Hydra overrides shared by every run (model path, data, ...).
        out_dir: where logs and the manifest go.
        project: ``trainer.project_name``.
        checkpoints: the root of the runs' checkpoint folders (``<checkpoints>/<run name>``); default
            ``<out_dir>/checkpoints``.
        loggers: verl's trackers of every run (``--logger``), or None: then those of a ``trainer.logger=`` override
            among ``base_overrides``, else verl's default; ``file`` is added either way (:func:`run_loggers`).
    """

    algorithms: tuple[str, ...] = ALGORITHMS
    reuse: tuple[int, ...] = PAPER_REUSE
    seeds: tuple[int, ...] = PAPER_SEEDS
    model: str = "model"
    preset: str | None = None
    routing: str | None = None
    entry: str = "respo"
    mini_batch: int = PAPER_MINI_BATCH
    optimizer_steps: int = PAPER_OPTIMIZER_STEPS
    base_overrides: tuple[str, ...] = ()
    out_dir: Path = Path("runs")
    project: str = "respo_verl_sweep"
    checkpoints: Path | None = None
    loggers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_name(self.model, "--model")
        if any(_key(o) == CHECKPOINT_KEY for o in self.base_overrides):
            raise ValueError(
                f"{CHECKPOINT_KEY} is set per run by the sweep (<checkpoint root>/<run name>, so that a run resumes "
                "from its own checkpoints only): choose the root with --checkpoints DIR instead"
            )
        swept = dict(SWEPT_KEYS)
        if self.preset:
            swept["cluster"] = "--preset"
        if self.routing:
            swept["routing"] = "--routing"
        for override in self.base_overrides:
            if _key(override) in swept:
                raise ValueError(
                    f"{override}: {_key(override)} is set per run by the sweep ({swept[_key(override)]}); "
                    "drop it from the shared overrides"
                )
        run_loggers(self)  # refuses an unknown logger, or --logger together with a trainer.logger override
        unknown = sorted(set(self.algorithms) - set(ALGORITHMS))
        if unknown:
            raise ValueError(f"unknown algorithm(s) {unknown}; choose from {list(ALGORITHMS)}")
        if not self.algorithms or not self.reuse or not self.seeds:
            raise ValueError("the grid is empty: give at least one algorithm, one N and one seed")
        if self.routing is not None and self.routing not in REPLAY_MODES:
            raise ValueError(f"routing must be one of {', '.join(REPLAY_MODES)}, got {self.routing!r}")
        if self.entry not in ENTRY_MODULES:
            raise ValueError(f"entry must be one of {sorted(ENTRY_MODULES)}, got {self.entry!r}")
        for n in self.reuse:
            if n < 1 or self.optimizer_steps % n:
                raise ValueError(f"N = {n} must be >= 1 and divide optimizer_steps = {self.optimizer_steps}")
        if self.mini_batch < 1:
            raise ValueError(f"mini_batch must be >= 1, got {self.mini_batch}")


def run_name(spec: SweepSpec, algorithm: str, reuse: int, seed: int) -> str:
    """The run's name in the package's one scheme (:func:`respo_verl.run.resolvers.run_name`), ``spec.model`` as its
    model tag."""
    return resolvers.run_name(spec.model, algorithm, reuse, seed, spec.routing)


def _logger_overrides(spec: SweepSpec) -> list[str]:
    return [o for o in spec.base_overrides if _key(o) == LOGGER_KEY]


def _parse_loggers(override: str) -> tuple[str, ...]:
    """The logger names of a ``trainer.logger=`` override (a list, or one name as verl also takes it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException as exc:
        raise ValueError(f"{override}: not a Hydra override ({str(exc).splitlines()[0]})") from None
    value = parsed.value()
    if parsed.is_delete() or value is None:
        raise ValueError(f"{override}: a run needs a logger ({REPORT_LOGGER} at least: the report reads it)")
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"{override}: {LOGGER_KEY} takes logger names, e.g. {LOGGER_KEY}=[console,wandb]")
    return tuple(names)


def run_loggers(spec: SweepSpec) -> tuple[str, ...]:
    """Every run's ``trainer.logger``: the user's trackers with :data:`REPORT_LOGGER` added at the end if missing.

    The user's are ``spec.loggers`` (``--logger``), else those of a ``trainer.logger=`` override among the shared
    overrides, else :data:`DEFAULT_LOGGERS`; repeated names count once.

    Raises:
        ValueError: a name that is not one of :data:`VERL_LOGGERS`, ``--logger`` together with a ``trainer.logger=``
            override (which would win is not obvious), more than one such override, or one without names.
    """
    overrides = _logger_overrides(spec)
    if len(overrides) > 1:
        raise ValueError(f"{' and '.join(overrides)}: give {LOGGER_KEY} once")
    if overrides and spec.loggers is not None:
        raise ValueError(
            f"--logger {','.join(spec.loggers)} and {overrides[0]} both name the runs' loggers: give one of them"
        )
    if spec.loggers is not None:
        given, source = tuple(spec.loggers), "--logger"
    elif overrides:
        given, source = _parse_loggers(overrides[0]), overrides[0]
    else:
        given, source = DEFAULT_LOGGERS, "default"
    if not given:
        raise ValueError(f"{source}: no logger named; choose from {', '.join(VERL_LOGGERS)}")
    unknown = [name for name in given if name not in VERL_LOGGERS]
    if unknown:
        raise ValueError(f"{source}: unknown logger(s) {', '.join(unknown)}; verl's are {', '.join(VERL_LOGGERS)}")
    return tuple(dict.fromkeys((*given, REPORT_LOGGER)))


def checkpoint_dir(spec: SweepSpec, name: str) -> Path:
    """The run's own checkpoint folder (absolute: a run may be started from any directory)."""
    root = spec.checkpoints if spec.checkpoints is not None else spec.out_dir / "checkpoints"
    return root.expanduser().resolve() / name


def run_overrides(spec: SweepSpec, algorithm: str, reuse: int, seed: int, engine: str | None = None) -> list[str]:
    """Hydra overrides of one run, in the form its entry point takes them.

    ``engine`` (the job's ``model_engine``) selects the engine's seed key (:data:`ENGINE_SEED_KEYS`); None leaves it
    out (the job is composed without it to learn the engine, see :func:`expand`).
    """
    plus = "" if spec.entry == "respo" else "+"
    overrides = [f"{plus}algorithm={algorithm}"]
    if spec.preset:
        overrides.append(f"+cluster={spec.preset}")
    if spec.routing:
        overrides.append(f"{plus}routing={spec.routing}")
    seed_keys = [*SEED_KEYS, *([] if engine is None else [engine_seed_key(engine)])]
    overrides += [
        *(o for o in spec.base_overrides if _key(o) != LOGGER_KEY),  # the run's own: see run_loggers
        f"data.train_batch_size={spec.mini_batch * reuse}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={spec.mini_batch}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        f"trainer.total_training_steps={spec.optimizer_steps // reuse}",
        f"trainer.project_name={spec.project}",
        f"trainer.experiment_name={run_name(spec, algorithm, reuse, seed)}",
        f"{CHECKPOINT_KEY}={checkpoint_dir(spec, run_name(spec, algorithm, reuse, seed))}",
        f"{LOGGER_KEY}=[{','.join(run_loggers(spec))}]",
        *(f"{key}={seed}" for key in seed_keys),
    ]
    return overrides


def engine_seed_key(engine: str) -> str:
    """The actor engine's seed key for ``model_engine=<engine>``; SweepError for an engine without a known one."""
    try:
        return ENGINE_SEED_KEYS[engine]
    except KeyError:
        raise SweepError(
            f"model_engine={engine}: no seed key known for this engine (known: {', '.join(ENGINE_SEED_KEYS)})"
        ) from None


def engine_of_overrides(overrides: Sequence[str]) -> str | None:
    """The engine a ``model_engine=`` override selects (the last one), or None when none does."""
    engines = [o.split("=", 1)[1] for o in overrides if _key(o) == "model_engine" and "=" in o]
    return engines[-1] if engines else None


def config_hash(job) -> str:
    """A run's ``config_hash`` in the manifest: :func:`respo_verl.checkpoint.config_hash` of the job without the
    per-run keys (seeds, run name, checkpoint folder) and with :data:`HASHED_LOGGERS` as its loggers, unresolved as
    manifests have always held it."""
    from omegaconf import OmegaConf

    job = job.copy()
    OmegaConf.update(job, LOGGER_KEY, list(HASHED_LOGGERS), merge=False)
    return checkpoint.config_hash(job, PER_RUN_KEYS, resolve=False)


def _versions() -> dict[str, str]:
    versions = {}
    for dist in ("respo-verl", "verl", "torch", "megatron-core", "vllm"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _job_of(spec: SweepSpec, algorithm: str, reuse: int, composed: dict[str, tuple[int, object]]):
    """The composed job of (algorithm, N), composing once per algorithm.

    Runs of one algorithm differ only in the values of :data:`REUSE_KEYS` (plain values of existing keys, which
    Hydra applies after composition), so the first N is composed and the others are that job with those values set;
    a test checks that this equals composing each N.
    """
    from omegaconf import OmegaConf

    first = spec.seeds[0]  # the engine's seed key is left out: the composed job says which engine it is
    if algorithm not in composed:
        composed[algorithm] = (reuse, compose_job(spec.entry, run_overrides(spec, algorithm, reuse, first)))
    base_reuse, base_job = composed[algorithm]
    if reuse == base_reuse:
        return base_job
    job = base_job.copy()
    for override in run_overrides(spec, algorithm, reuse, first):
        if _key(override) in REUSE_KEYS:
            OmegaConf.update(job, _key(override), int(override.split("=", 1)[1]), merge=False)
    return job


# The GPU slots of a run: verl's V1 trainer asks Ray for one resource pool of nnodes x n_gpus_per_node GPUs, and one
# more of each size where the reward model or a distillation teacher has a pool of its own (trainer_base.py,
# ``init_resource_pool_mgr``). With --no-compose only the shared overrides say it, and only the trainer's pool.
GPU_POOLS = (
    ("trainer", None),
    ("reward.reward_model", "reward.reward_model.enable_resource_pool"),
    ("distillation", "distillation.enabled"),
)


def job_gpus(job) -> int:
    """The GPU slots a run of the composed ``job`` takes on its Ray cluster (:data:`GPU_POOLS`)."""
    from omegaconf import OmegaConf

    total = 0
    for pool, switch in GPU_POOLS:
        if switch is not None and not OmegaConf.select(job, switch, default=False):
            continue
        total += int(OmegaConf.select(job, f"{pool}.nnodes")) * int(OmegaConf.select(job, f"{pool}.n_gpus_per_node"))
    return total


def overrides_gpus(overrides: Sequence[str]) -> int | None:
    """The GPU slots of a run from ``trainer.nnodes=`` and ``trainer.n_gpus_per_node=`` among ``overrides`` (the last
    of each), or None when one of them is missing; ValueError naming an override whose value is not a whole number
    of at least 1."""
    values = {}
    for key in ("trainer.nnodes", "trainer.n_gpus_per_node"):
        given = [o.split("=", 1)[1] for o in overrides if _key(o) == key and "=" in o and not o.startswith("~")]
        if not given:
            return None
        if not given[-1].isdigit() or int(given[-1]) < 1:
            raise ValueError(f"{key}={given[-1]}: a run needs a whole number of at least 1 there")
        values[key] = int(given[-1])
    return values["trainer.nnodes"] * values["trainer.n_gpus_per_node"]


def expand(spec: SweepSpec, compose: bool = True) -> list[RunRecord]:
    """One :class:`RunRecord` per grid point (:func:`expand_with_gpus` without the GPU slots)."""
    return expand_with_gpus(spec, compose)[0]


def expand_with_gpus(spec: SweepSpec, compose: bool = True) -> tuple[list[RunRecord], dict[str, int | None]]:
    """One :class:`RunRecord` per grid point, and the GPU slots each run takes by its name: :func:`job_gpus` of its
    composed job, or without ``compose`` :func:`overrides_gpus` of the shared overrides (None where they do not say).

    With ``compose``, the job of every distinct configuration (one per algorithm and N: seeds differ only in the
    per-run keys, which the hash leaves out) is composed as its entry point composes it, checked with
    :func:`respo_verl.run.jobcheck.check_job` and hashed, before anything is printed or launched. Hydra runs once
    per algorithm (:func:`_job_of`). The composed job's ``model_engine`` selects the engine's seed key; without
    ``compose`` only a ``model_engine=`` among the base overrides does, and without one that key is not set.

    Raises:
        SweepError: a run's job does not compose or does not pass the check (naming the run).
    """
    from omegaconf import OmegaConf

    from respo_verl.run.jobcheck import check_job

    records, gpus = [], {}
    shared_gpus = None if compose else overrides_gpus(spec.base_overrides)
    versions = _versions()
    logs_dir = spec.out_dir / "logs"
    composed: dict[str, tuple[int, object]] = {}
    for algorithm in spec.algorithms:
        engine = engine_of_overrides(spec.base_overrides)
        for reuse in spec.reuse:
            digest, slots = "", shared_gpus
            first = run_name(spec, algorithm, reuse, spec.seeds[0])
            if compose:
                try:
                    job = _job_of(spec, algorithm, reuse, composed)
                except ComposeError as exc:
                    raise SweepError(f"run {first}: {exc}") from None
                try:
                    check_job(job)
                except ValueError as exc:
                    raise SweepError(f"run {first}: {exc}") from None
                digest, slots = config_hash(job), job_gpus(job)
                engine = OmegaConf.select(job, "model_engine", default=None)
            if engine is not None:
                try:
                    engine_seed_key(engine)
                except SweepError as exc:
                    raise SweepError(f"run {first}: {exc}") from None
            for seed in spec.seeds:
                name = run_name(spec, algorithm, reuse, seed)
                overrides = run_overrides(spec, algorithm, reuse, seed, engine)
                log = logs_dir / f"{name}.jsonl"
                records.append(
                    RunRecord(
                        name=name,
                        algorithm=algorithm,
                        reuse=reuse,
                        seed=seed,
                        log=str(log.relative_to(spec.out_dir)),
                        optimizer_steps=spec.optimizer_steps,
                        config_hash=digest,
                        command=[PYTHON, "-m", ENTRY_MODULES[spec.entry], *overrides],
                        env={"VERL_FILE_LOGGER_PATH": str(log.resolve())},
                        preset=spec.preset,
                        routing=spec.routing,
                        versions=versions,
                    )
                )
                gpus[name] = slots
    return records, gpus
