"""Running the miniature's configurations: one job per configuration, in this process or in worker processes.

:func:`run_job` trains one configuration and returns a :class:`JobResult`; :func:`execute` runs a list of jobs on
``workers`` processes (spawned, each with its own torch threads) and keeps their order; :func:`record` is the run's
manifest entry (read by ``respo-verl report``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

COMMAND = ("python", "-m", "experiments.mini")


@dataclass(frozen=True)
class Job:
    """Everything a worker process needs to run one configuration."""

    cfg: object  # train.RunConfig (imported lazily: torch)
    spec: object  # model.ModelSpec
    warm: object  # model.WarmStart
    cache_dir: Path
    out: Path
    threads: int
    shipped: bool


@dataclass(frozen=True)
class JobResult:
    """What the summary needs of one finished run (picklable: it comes back from a worker process).

    Attributes:
        regime: the run's regime checks (``regime.RegimeCheck``), pooled over its stale mini-batches.
        stale_totals, stale_shares: the parts of ``regime`` that pool over runs (``regime.pool``).
        first_score: the mean score of the first rollout batch, in [0, 1].
        last_quarter_length_ratio: mean correct / mean wrong answer length over the last quarter (NaN if either is
            missing), and ``last_quarter_correct_length`` the first of the two.
    """

    name: str
    log: Path
    regime: object
    stale_totals: dict[str, float]
    stale_shares: list[float]
    first_score: float
    last_quarter_length_ratio: float
    last_quarter_correct_length: float
    wall_s: float

    def as_dict(self) -> dict:
        """JSON-ready (``summary.json``)."""
        out = asdict(self)
        out["log"] = str(self.log)
        out["regime_line"], out["holds"] = self.regime.line(), self.regime.holds
        return out


def quiet() -> None:
    """Keep import-time notices of verl, megatron-core and transformers (engines and kernels a CPU run does not use)
    out of the progress bars."""
    import logging

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("verl", "megatron", "transformers", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def preload(algos: list[str]) -> None:
    """Compose each algorithm and call verl's advantage path once, with verl's logging off: verl reports on first use
    that it found no accelerator (expected on CPU), which would otherwise break into the progress bars."""
    import logging

    import torch

    from experiments.mini import verl_adapter

    logging.disable(logging.WARNING)
    try:
        for algo in algos:
            setup = verl_adapter.load_algorithm(algo)
            mask = torch.ones(2, 1, dtype=torch.bool)
            verl_adapter.compute_advantages(setup, torch.tensor([[1.0], [-1.0]]), mask, ["a", "a"])
    finally:
        logging.disable(logging.NOTSET)


def _init_worker(threads: int, algos: list[str]) -> None:
    import torch

    quiet()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    preload(algos)


def _mean_or_nan(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan


RESULT_SUFFIX = ".result.json"


def result_path(log: Path) -> Path:
    """Where a finished run keeps its :class:`JobResult` beside its log (written after the log is complete)."""
    return Path(log).with_suffix(RESULT_SUFFIX)


def _log_path(job: Job) -> Path:
    from experiments.mini.train import PROJECT_NAME

    return Path(job.out) / PROJECT_NAME / f"{job.cfg.name}.jsonl"


def _write_result(job: Job, result: JobResult) -> None:
    data = asdict(result)
    data["log"] = str(result.log)
    del data["regime"]  # rebuilt from stale_totals and stale_shares
    data["config_hash"] = config_hash(job.cfg)
    path = result_path(result.log)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # atomic: a result file exists only whole


def completed(job: Job) -> JobResult | None:
    """The result of ``job`` when an earlier invocation finished it: its log has every optimizer step and its result
    file (same configuration hash) was written after it. None otherwise (the run is then done afresh)."""
    from experiments.mini import regime

    log, path = _log_path(job), result_path(_log_path(job))
    if not (log.is_file() and path.is_file()):
        return None
    try:
        data = json.loads(path.read_text())
        lines = log.read_bytes().splitlines()
        last_step = json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return None
    if data.pop("config_hash", None) != config_hash(job.cfg) or len(lines) != job.cfg.optimizer_steps:
        return None
    if last_step != job.cfg.optimizer_steps:
        return None
    data["log"] = log
    data["regime"] = regime.from_totals(job.cfg.reuse, data["stale_totals"], data["stale_shares"])
    return JobResult(**data)


def run_job(job: Job, progress=None) -> JobResult:
    """Train one configuration (in this or a worker process); ``progress.put(n)`` reports n more updates."""
    from experiments.mini import model as model_lib
    from experiments.mini import regime
    from experiments.mini.train import train

    base, _ = model_lib.warm_start(job.spec, job.warm, job.cache_dir, shipped=job.shipped, task_name=job.cfg.task)
    pending = [0]

    def tick(step: int) -> None:
        pending[0] += 1
        if progress is not None and (pending[0] >= 16 or step == job.cfg.optimizer_steps):
            progress.put(pending[0])
            pending[0] = 0

    result = train(job.cfg, base, job.out, on_step=tick)
    data = [r["data"] for r in result.records]
    quarter = data[-max(1, len(data) // 4) :]
    correct = _mean_or_nan([d["mini/response_length/correct_mean"] for d in quarter])
    wrong = _mean_or_nan([d["mini/response_length/wrong_mean"] for d in quarter])
    out = JobResult(
        name=job.cfg.name,
        log=Path(result.log_path),
        regime=result.regime,
        stale_totals=regime.stale_totals(job.cfg.reuse, result.records),
        stale_shares=list(result.stale_single_token_shares),
        first_score=data[0]["mini/score"],
        last_quarter_length_ratio=correct / wrong if not (math.isnan(correct) or math.isnan(wrong)) else math.nan,
        last_quarter_correct_length=correct,
        wall_s=result.wall_s,
    )
    _write_result(job, out)
    return out


class _BarProgress:
    """``put(n)`` advances a tqdm bar (the in-process stand-in for the workers' queue)."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def put(self, n: int) -> None:
        self.bar.update(n)


def execute(jobs: list[Job], workers: int, bar, resume: bool = False) -> list[JobResult]:
    """Run ``jobs`` in ``workers`` processes (in this process for one), updating ``bar`` as updates complete.

    With ``resume``, a job an earlier invocation finished (:func:`completed`) is not run again: its result is read
    back from its output folder. Two jobs that would write the same log are refused before any runs.
    """
    logs: dict[Path, Job] = {}
    for job in jobs:
        other = logs.setdefault(_log_path(job), job)
        if other is not job:
            raise ValueError(f"two runs would write the same log {_log_path(job)}: {other.cfg} and {job.cfg}")
    if resume:
        done = [completed(job) for job in jobs]
        for job, result in zip(jobs, done):
            if result is not None:
                print(f"{job.cfg.name}: complete in {job.out}, skipped", flush=True)
                bar.update(job.cfg.optimizer_steps)
        todo = [job for job, result in zip(jobs, done) if result is None]
        fresh = iter(execute(todo, workers, bar) if todo else [])
        return [result if result is not None else next(fresh) for result in done]
    if workers == 1 or len(jobs) == 1:
        # verl is imported here only when this process trains: with workers, each worker preloads (_init_worker) and
        # this process never imports it (about 9 CPU seconds of quick mode's)
        preload(sorted({job.cfg.algorithm for job in jobs}))
        out = []
        for job in jobs:
            bar.set_description(job.cfg.name)
            out.append(run_job(job, _BarProgress(bar)))
        return out
    return _execute_in_workers(jobs, workers, bar)


def _execute_in_workers(jobs: list[Job], workers: int, bar) -> list[JobResult]:
    import multiprocessing
    import queue
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    context = multiprocessing.get_context("spawn")
    initargs = (jobs[0].threads, sorted({j.cfg.algorithm for j in jobs}))
    results: list[JobResult | None] = [None] * len(jobs)
    with (
        context.Manager() as manager,
        ProcessPoolExecutor(
            max_workers=min(workers, len(jobs)), mp_context=context, initializer=_init_worker, initargs=initargs
        ) as pool,
    ):
        progress = manager.Queue()
        futures = {pool.submit(run_job, job, progress): i for i, job in enumerate(jobs)}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            while True:
                try:
                    bar.update(progress.get_nowait())
                except queue.Empty:
                    break
            for future in done:
                results[futures[future]] = future.result()
                bar.set_description(f"{sum(r is not None for r in results)}/{len(jobs)} runs")
    return results


LATER_OPTIONS = {"held_out": False, "task": "chain"}


def config_hash(cfg) -> str:
    """Everything that defines a setting except its seeds: the seeds of one setting share the hash."""
    setting = {k: v for k, v in asdict(cfg).items() if k not in ("seed", "warm_seed")}
    # Options added after runs were made are left out at their default, so those runs keep their hash.
    setting = {k: v for k, v in setting.items() if not (k in LATER_OPTIONS and v == LATER_OPTIONS[k])}
    return hashlib.sha256(json.dumps(setting, sort_keys=True, default=str).encode()).hexdigest()


def record(cfg, log: Path, out: Path, argv: list[str], versions: dict[str, str]):
    """The manifest entry of one run (``respo_verl.tools.runs.manifest.RunRecord``), its log relative to ``out``."""
    from respo_verl.tools.runs.manifest import RunRecord

    return RunRecord(
        name=cfg.name,
        algorithm=cfg.algorithm,
        reuse=cfg.reuse,
        seed=cfg.seed,
        log=str(Path(log).resolve().relative_to(out)),
        optimizer_steps=cfg.optimizer_steps,
        config_hash=config_hash(cfg),
        command=[*COMMAND, *argv],
        versions=versions,
        source="mini",
        log_step="optimizer",
    )
