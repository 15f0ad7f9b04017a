"""One run of the miniature experiment: RLVR with rollout reuse N on the tiny model, one algorithm, one seed.

The schedule is the paper's (arXiv 2609.35433): each training step (``collect``) samples a rollout batch of
P prompts × G responses from the current policy, scores it with the verifier, computes GRPO advantages with verl's
``compute_advantage`` and recomputes π_old once (no gradient); then N mini-batches of P/N prompts are applied one
after another (``update``, ppo_epochs 1), so the j-th mini-batch is j−1 optimizer steps stale. Each update calls the
preset's loss from verl's registry (``experiments.mini.verl_adapter``) and steps AdamW.

Logging (verl's file-logger format): one JSON line ``{"step": <optimizer step>, "data": {...}}`` per optimizer step,
``step`` counting optimizer steps from 1; ``data["training/global_step"]`` is verl's training step (rollout batch,
from 1), so ``step = (training step − 1)·N + j``. verl's own trainer writes one line per training step with ``step`` =
training step; a reader compares the two by optimizer steps (a verl line covers N of them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import torch

from experiments.mini import regime, tasks, verl_adapter
from experiments.mini.rollout import Rollout, response_log_prob, response_log_prob_no_grad, sample
from respo_verl.core import kernel_diagnostics
from respo_verl.core.config import DEFAULT_LOG_W_CLIP
from respo_verl.core.diagnostics import INDEPENDENT_STARVED_MASS_KEY, diagnostic_keys, effective_terms
from respo_verl.routing.hf import RoutingReplay

# The sequence log-weight is clamped to ±20 by every kernel; the diagnostics use the same clamp.
LOG_W_CLIP = DEFAULT_LOG_W_CLIP
# The paper's optimiser protocol: 5 % linear warm-up of the learning rate, gradient clipping at 1.0.
WARMUP_SHARE = 0.05
GRAD_CLIP = 1.0
PROJECT_NAME = "respo_verl_mini"  # verl's FileLogger writes <root>/<project_name>/<experiment_name>.jsonl


def lr_label(lr: float) -> str:
    """The learning rate as run names write it: the fewest significant digits that read back as ``lr`` exactly.

    ``4e-04`` for 4e-4 (the names every earlier run has), ``3.5e-04`` for 3.5e-4: two rates never share a label,
    so their runs never share a log file, and a run already complete is never taken for another rate's.
    """
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"learning rate must be a positive number, got {lr!r}")
    for digits in range(17):
        label = f"{lr:.{digits}e}"
        if float(label) == lr:
            return label
    raise AssertionError(f"{lr!r} has no exponent form that reads back")  # repr(float) round-trips in 17 digits


@dataclass(frozen=True)
class RunConfig:
    """One run.

    Attributes:
        algorithm: preset name (``grpo``, ``gspo``, ``vespo``, ``respo``).
        reuse: N, mini-batches per rollout batch.
        seed: RL seed (prompts, sampling); the base model is shared by all seeds.
        optimizer_steps: total updates (a multiple of N); training steps = optimizer_steps / N.
        rollout_prompts: P, prompts per rollout batch (a multiple of N).
        group_size: G, responses per prompt.
        lr: peak AdamW learning rate.
        warm_seed: seed of the warm start the run starts from (recorded in the run's name).
        weight_decay: AdamW weight decay (the paper's 0.1).
        routing_replay: R2 routing replay (MoE models): the experts chosen in the π_old forward are replayed in
            every update forward of the same rollout batch, so log W carries no expert flips (docs/routing-replay.md).
        held_out: train only on the problems outside ``task.held_out_problems()`` and score the final policy on
            those held out (:func:`evaluate`, logged with the last update as ``mini/eval/*``).
        task: the task's name (``tasks.TASKS``); a run of another task than the chain task carries it in its name.
    """

    algorithm: str
    reuse: int
    seed: int
    optimizer_steps: int
    rollout_prompts: int
    group_size: int = 8
    lr: float = 1e-4
    warm_seed: int = 0
    weight_decay: float = 0.1
    routing_replay: bool = False
    held_out: bool = False
    task: str = tasks.DEFAULT

    @property
    def training_steps(self) -> int:
        return self.optimizer_steps // self.reuse

    @property
    def name(self) -> str:
        replay = "_r2" if self.routing_replay else ""
        held_out = "_ho" if self.held_out else ""
        lr = lr_label(self.lr)
        name = f"{self.algorithm}_n{self.reuse}_lr{lr}_w{self.warm_seed}_seed{self.seed}{replay}{held_out}"
        return tasks.get(self.task).run_name(name)


@dataclass
class UpdateEvent:
    """What an update callback sees (tests instrument the schedule with it).

    Attributes:
        training_step, minibatch: 1-based training step and 0-based mini-batch index j (staleness j).
        old_log_prob: (B, T) π_old of the whole rollout batch (the same tensor for every mini-batch of a step).
        rows: the mini-batch's rows of the rollout batch.
        log_prob: (b, T) π_θ of the mini-batch before this update.
        params_before: parameter checksum before the optimizer step.
        params_after: parameter checksum after it.
        rollout: the mini-batch's rows of the rollout batch.
        policy: the policy after this update (diagnostics may run a forward with it, without gradient).
    """

    training_step: int
    minibatch: int
    old_log_prob: torch.Tensor
    rows: slice
    log_prob: torch.Tensor
    params_before: float
    params_after: float
    rollout: Rollout
    policy: torch.nn.Module


@dataclass
class RunResult:
    """Per-optimizer-step series of one run (also in its JSONL log).

    Attributes:
        stale_single_token_shares: per starved positive of the stale half of the rollout batches, the share of its
            log W carried by its most negative token (``regime.update_counts``).
    """

    config: RunConfig
    log_path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    stale_single_token_shares: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def regime(self) -> regime.RegimeCheck:
        return regime.summarise(self.config.reuse, self.records, self.stale_single_token_shares)


def _checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _lr_at(step: int, cfg: RunConfig) -> float:
    warmup = max(1, math.ceil(WARMUP_SHARE * cfg.optimizer_steps))
    return cfg.lr * min(1.0, step / warmup)


def starvation_diagnostics(
    log_prob: torch.Tensor,
    grad_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """The starvation diagnostics for any algorithm, through ``respo_verl.core.kernel_diagnostics``.

    φ is the effective coefficient the loss gave each sequence (``respo_verl.core.diagnostics.effective_terms``); the
    starved mass share is then the starved positives' share of Σ|∂loss/∂log π_θ|, the gradient the loss actually gave.
    It is logged under the key verl's trainer logs it under for every loss (``INDEPENDENT_STARVED_MASS_KEY``), the
    other diagnostics under ``mini/diag/``.
    """
    terms = effective_terms(log_prob, grad_log_prob, old_log_prob, advantages, response_mask, LOG_W_CLIP)
    values = kernel_diagnostics(terms).tolist()
    out = {f"mini/diag/{k}": v for k, v in zip(diagnostic_keys(), values, strict=True)}
    out[INDEPENDENT_STARVED_MASS_KEY] = out.pop("mini/diag/starved_mass_share")
    return out


def _masked_mean(values: torch.Tensor, member: torch.Tensor) -> float:
    return float(values[member].float().mean()) if bool(member.any()) else math.nan


def rollout_metrics(
    rollout: Rollout, reward: torch.Tensor, advantages: torch.Tensor, task: tasks.Task | None = None
) -> dict[str, float]:
    """verl's data metrics of the rollout batch (verl's names) plus ours under ``mini/``, the shares of the task's
    endings (``tasks.Task.ending_metrics``) among them."""
    task = task or tasks.get(tasks.DEFAULT)
    grammar = task.module
    lengths = rollout.response_mask.sum(dim=1).float()  # (B,)
    correct = reward > 0  # (B,)
    adv_valid = advantages[rollout.response_mask]
    ending = task.ending(rollout.response, rollout.prompts)  # (B,)
    ended_by_eos = (rollout.response == grammar.EOS).any(dim=1)  # (B,)
    return {
        # verl: score = sequence score from the reward function (here ±1), rewards = score without KL penalty.
        "critic/score/mean": float(reward.mean()),
        "critic/score/max": float(reward.max()),
        "critic/score/min": float(reward.min()),
        "critic/rewards/mean": float(reward.mean()),
        "critic/rewards/max": float(reward.max()),
        "critic/rewards/min": float(reward.min()),
        "critic/advantages/mean": float(adv_valid.mean()),
        "critic/advantages/max": float(adv_valid.max()),
        "critic/advantages/min": float(adv_valid.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        # verl's share of responses that reach the length budget without <eos> (the grammar ends them before).
        "response_length/clip_ratio": float(((lengths >= grammar.MAX_RESPONSE_LEN) & ~ended_by_eos).float().mean()),
        # The paper's score (reward + 1) / 2 of the rollout batch.
        "mini/score": float(((reward + 1) / 2).mean()),
        "mini/response_length/correct_mean": _masked_mean(lengths, correct),
        "mini/response_length/wrong_mean": _masked_mean(lengths, ~correct),
        **{f"mini/{name}_frac": float((ending == value).float().mean()) for name, value in task.ending_metrics.items()},
        "mini/steps_written/wrong_mean": _masked_mean(grammar.steps_written(rollout.response).float(), ~correct),
    }


@dataclass
class RolloutBatch:
    """One training step's data: sampled, scored, with advantages and π_old (and R2 routes when replaying).

    Attributes:
        training_step: 1-based.
        rollout: P·G responses.
        reward: (B,) ±1.
        advantages: (B, T) from verl's ``compute_advantage``.
        old_log_prob: (B, T) π_old, recomputed once before the first update (verl's default).
        routes: R2 routes of the π_old forward per layer, (B, L, k); None without routing replay.
        metrics: rollout metrics and timings logged with every update of the batch.
    """

    training_step: int
    rollout: Rollout
    reward: torch.Tensor
    advantages: torch.Tensor
    old_log_prob: torch.Tensor
    routes: dict[int, torch.Tensor] | None
    metrics: dict[str, float]


@dataclass
class _RunState:
    """What persists across the updates of a run."""

    cfg: RunConfig
    setup: verl_adapter.AlgorithmSetup
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    replay: RoutingReplay | None
    prompt_gen: torch.Generator
    sample_gen: torch.Generator
    task: tasks.Task
    step: int = 0


def collect(state: _RunState, training_step: int) -> RolloutBatch:
    """Sample a rollout batch from the current policy, score it, compute advantages and π_old."""
    cfg, model, grammar = state.cfg, state.model, state.task.module
    t0 = time.perf_counter()
    model.eval()
    draw = grammar.sample_training_prompts if cfg.held_out else grammar.sample_prompts
    prompts = draw(cfg.rollout_prompts, state.prompt_gen).repeat_interleave(cfg.group_size)
    rollout = sample(model, prompts, grammar.MAX_RESPONSE_LEN, state.sample_gen, grammar)
    t_gen = time.perf_counter() - t0
    reward = state.task.verify(rollout.response, rollout.prompts)  # (B,)
    mask = rollout.response_mask  # (B, T)
    token_level_rewards = torch.zeros(mask.shape)  # (B, T)
    token_level_rewards[torch.arange(mask.shape[0]), mask.sum(dim=1) - 1] = reward
    uids = [f"{training_step}-{i // cfg.group_size}" for i in range(mask.shape[0])]
    advantages = verl_adapter.compute_advantages(state.setup, token_level_rewards, mask, uids)  # (B, T)
    t1 = time.perf_counter()
    routes = None
    with torch.no_grad():
        if state.replay is None:
            old_log_prob = response_log_prob_no_grad(model, rollout)  # (B, T)
        else:
            with state.replay.record() as flat_routes:  # R2: record the π_old forward's experts
                old_log_prob = response_log_prob(model, rollout)  # (B, T)
            seq_len = rollout.prompts.input_ids.shape[1] + rollout.response.shape[1]
            routes = {layer: r.view(-1, seq_len, r.shape[-1]) for layer, r in flat_routes.items()}  # (B, L, k)
    metrics = rollout_metrics(rollout, reward, advantages, state.task)
    metrics |= {"timing_s/gen": t_gen, "timing_s/old_log_prob": time.perf_counter() - t1}
    return RolloutBatch(training_step, rollout, reward, advantages, old_log_prob, routes, metrics)


def update(
    state: _RunState, batch: RolloutBatch, j: int, on_update: Callable[[UpdateEvent], None] | None
) -> tuple[dict[str, Any], list[float]]:
    """Apply mini-batch ``j`` of ``batch`` (j optimizer steps stale) with the preset's registered loss.

    Returns:
        The update's log data and the single-token shares of its starved positives (``regime.update_counts``).
    """
    cfg, model, optimizer = state.cfg, state.model, state.optimizer
    t0 = time.perf_counter()
    mb_rows = cfg.rollout_prompts // cfg.reuse * cfg.group_size
    rows = slice(j * mb_rows, (j + 1) * mb_rows)
    mb = batch.rollout.rows(rows)
    mb_mask = mb.response_mask
    old_log_prob, advantages = batch.old_log_prob[rows], batch.advantages[rows]
    lr = _lr_at(state.step + 1, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    model.train()
    if state.replay is None:
        log_prob = response_log_prob(model, mb)  # (b, T)
    else:
        mb_routes = {layer: r[rows] for layer, r in batch.routes.items()}  # (b, L, k)
        tokens = torch.cat([mb.prompts.attention_mask.bool(), mb_mask], dim=1)  # (b, L): not padding
        with state.replay.replay(mb_routes, token_mask=tokens):
            log_prob = response_log_prob(model, mb)  # (b, T)
    log_prob.retain_grad()
    verl_adapter.set_global_batch_info(state.setup.actor_config, int(mb_mask.sum()), mb_mask.shape[0])
    pg_loss, loss_metrics = verl_adapter.policy_loss(state.setup, old_log_prob, log_prob, advantages, mb_mask)
    optimizer.zero_grad(set_to_none=True)
    pg_loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP))
    before = _checksum(model) if on_update is not None else 0.0
    optimizer.step()
    state.step += 1
    grad_log_prob, log_prob = log_prob.grad, log_prob.detach()
    diag = starvation_diagnostics(log_prob, grad_log_prob, old_log_prob, advantages, mb_mask)
    counts, shares = regime.update_counts(log_prob, old_log_prob, advantages, mb_mask, state.task.high_tail)
    if on_update is not None:
        event = UpdateEvent(
            batch.training_step, j, batch.old_log_prob, rows, log_prob, before, _checksum(model), mb, model
        )
        on_update(event)
    data = {
        "training/global_step": batch.training_step,
        "mini/optimizer_step": state.step,
        "mini/minibatch": j,
        "mini/reuse": cfg.reuse,
        **batch.metrics,
        "mini/score_minibatch": float(((batch.reward[rows] + 1) / 2).mean()),
        "actor/pg_loss": float(pg_loss.detach()),
        "actor/lr": lr,
        "actor/grad_norm": grad_norm,
        "mini/grad_clipped": float(grad_norm > GRAD_CLIP),
        **loss_metrics,
        **diag,
        **counts,
        **(state.replay.diagnostics() if state.replay is not None else {}),
        "timing_s/update_actor": time.perf_counter() - t0,
    }
    return data, shares


# The held-out evaluation: every held-out problem answered EVAL_SAMPLES times at temperature 1, from one fixed
# sampling stream for every run (so two runs' final policies are scored on the same random numbers).
EVAL_SAMPLES = 16
EVAL_SEED = 31_337


def evaluate(model: torch.nn.Module, task: tasks.Task | None = None) -> dict[str, float]:
    """Score ``model`` on the held-out problems: ``mini/eval/score`` is the mean (reward + 1)/2 of
    ``task.N_HELD_OUT`` × :data:`EVAL_SAMPLES` sampled answers."""
    model.eval()
    task = task or tasks.get(tasks.DEFAULT)
    grammar = task.module
    prompts = grammar.prompts_of(grammar.problem_digits(grammar.held_out_problems())).repeat_interleave(EVAL_SAMPLES)
    rollout = sample(model, prompts, grammar.MAX_RESPONSE_LEN, torch.Generator().manual_seed(EVAL_SEED), grammar)
    reward = task.verify(rollout.response, rollout.prompts)  # (B,)
    return {
        "mini/eval/score": float(((reward + 1) / 2).mean()),
        "mini/eval/responses": float(reward.numel()),
        "mini/eval/response_length_mean": float(rollout.response_mask.sum(dim=1).float().mean()),
    }


def train(
    cfg: RunConfig,
    base_model: torch.nn.Module,
    log_dir: Path,
    on_update: Callable[[UpdateEvent], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> RunResult:
    """Run RL from a copy of ``base_model`` and log every optimizer step.

    Args:
        cfg: the run.
        base_model: the warm-started model (not modified).
        log_dir: verl's ``VERL_FILE_LOGGER_ROOT``; the log is ``<log_dir>/respo_verl_mini/<cfg.name>.jsonl``.
        on_update: called after every optimizer step (instrumentation).
        on_step: called with the optimizer step after every update (progress bars).
    """
    import copy

    setup = verl_adapter.load_algorithm(cfg.algorithm)
    model = copy.deepcopy(base_model).train()
    torch.manual_seed(cfg.seed)
    state = _RunState(
        cfg=cfg,
        setup=setup,
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay),
        replay=RoutingReplay(model) if cfg.routing_replay else None,
        prompt_gen=torch.Generator().manual_seed(cfg.seed),
        sample_gen=torch.Generator().manual_seed(cfg.seed + 1_000_003),  # independent stream for sampling
        task=tasks.get(cfg.task),
    )
    log_path = Path(log_dir) / PROJECT_NAME / f"{cfg.name}.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    result = RunResult(cfg, log_path)
    start = time.perf_counter()
    try:
        with open(log_path, "wb", buffering=0) as log:
            for training_step in range(1, cfg.training_steps + 1):
                batch = collect(state, training_step)
                for j in range(cfg.reuse):
                    data, shares = update(state, batch, j, on_update)
                    if cfg.held_out and state.step == cfg.optimizer_steps:
                        data |= evaluate(state.model, state.task)
                    data["mini/wall_time_s"] = time.perf_counter() - start
                    record = {"step": state.step, "data": data}
                    log.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
                    result.records.append(record)
                    if j >= cfg.reuse // 2:
                        result.stale_single_token_shares += shares
                    if on_step is not None:
                        on_step(state.step)
    finally:
        if state.replay is not None:
            state.replay.remove()  # the caller's model is a copy, but hooks must not outlive a failed run either
    result.wall_s = time.perf_counter() - start
    return result
