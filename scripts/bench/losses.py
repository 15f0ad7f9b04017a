"""Forward+backward cost of the ``respo`` and ``vespo`` policy losses against verl's ``vanilla`` and ``gspo``.

Each loss is fetched from verl's registry (``get_policy_loss_fn``) and called exactly as verl's ``ppo_loss`` calls
it, with the actor config composed from its own preset (``algorithm=respo|vespo|grpo|gspo`` of our
``respo_trainer``), so ``gspo`` aggregates with seq-mean-token-mean as in the paper. The metrics each loss returns
(and their host synchronisations) are part of the measured cost.

Timing is interleaved in one process: every repeat runs each loss once, in an order rotated per repeat, so slow
phases of a shared machine hit all losses alike; the per-repeat ratio to ``vanilla`` (paired) is the robust number.

Usage (CPU quick check, then the default sizes)::

    .venv/bin/python scripts/bench/losses.py --batch 16 --length 512 --repeats 3
    .venv/bin/python scripts/bench/losses.py --json bench.json
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from common import cpu_name, quartiles, write_json

from respo_verl import algorithms
from respo_verl.run.compose import CPU_COMPOSE_OVERRIDES

# The preset whose loss (verl's PPO-clip, ``vanilla``) is the reference of every ratio.
REFERENCE_PRESET = "grpo"
# Acceptance target: ReSPO may cost at most 10% more than verl's PPO-clip loss.
TARGET = ("respo", 1.10)
MIB = 2**20


def actor_config(algorithm: str) -> Any:
    """verl's actor dataclass composed from ``respo_trainer`` with ``algorithm=<algorithm>``, as verl builds it."""
    from verl.utils.config import omega_conf_to_dataclass

    from respo_verl.run.compose import compose_job

    cfg = compose_job("respo", [f"algorithm={algorithm}", *CPU_COMPOSE_OVERRIDES])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


@dataclass
class Inputs:
    old_log_prob: torch.Tensor  # (B, T)
    log_prob: torch.Tensor  # (B, T) data of the leaf made fresh for every call
    advantages: torch.Tensor  # (B, T) fp32, one value per sequence, 0 on padding (as verl's GRPO estimator)
    response_mask: torch.Tensor  # (B, T) bool

    @property
    def n_tokens(self) -> int:
        return int(self.response_mask.sum())


def make_inputs(batch: int, length: int, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    """Right-padded responses of lengths ~ U[L/4, L], log-probs around −1, new = old + small noise."""
    gen = torch.Generator().manual_seed(seed)
    n_tok_seq = torch.randint(max(length // 4, 1), length + 1, (batch,), generator=gen)  # (B,)
    mask = torch.arange(length).unsqueeze(0) < n_tok_seq.unsqueeze(1)  # (B, T)
    zero = torch.zeros(())
    old_log_prob = torch.where(mask, -1.0 + 0.3 * torch.randn(batch, length, generator=gen), zero)  # (B, T)
    # Per-token drift 0.01 gives log W of order ±1 over thousands of tokens: near on-policy, the usual regime.
    log_prob = torch.where(mask, old_log_prob + 0.01 * torch.randn(batch, length, generator=gen), zero)  # (B, T)
    adv_seq = torch.randn(batch, generator=gen)  # (B,) standardised group scores, both signs
    advantages = adv_seq.unsqueeze(1) * mask  # (B, T)
    return Inputs(
        old_log_prob.to(device=device, dtype=dtype),
        log_prob.to(device=device, dtype=dtype),
        advantages.to(device=device),
        mask.to(device=device),
    )


def run_once(
    loss_fn: Any, config: Any, inputs: Inputs, log_prob: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    """One call as verl's ppo_loss makes it, then backward into ``log_prob`` (default: a fresh leaf).

    Returns:
        (loss, metrics, leaf).
    """
    if log_prob is None:
        log_prob = inputs.log_prob.detach().requires_grad_(True)
    loss, metrics = loss_fn(
        old_log_prob=inputs.old_log_prob,
        log_prob=log_prob,
        advantages=inputs.advantages,
        response_mask=inputs.response_mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=None,
    )
    loss.backward()
    return loss, metrics, log_prob


def timed_call(loss_fn: Any, config: Any, inputs: Inputs, cuda: bool) -> float:
    """Seconds of one forward+backward (synchronised on CUDA); freeing the outputs happens outside the window."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = run_once(loss_fn, config, inputs)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if not torch.isfinite(outputs[0]) or outputs[2].grad is None:
        raise RuntimeError("loss is not finite or produced no gradient")
    del outputs
    return elapsed


def peak_extra_bytes(loss_fn: Any, config: Any, inputs: Inputs, cuda: bool) -> int:
    """Peak bytes held by torch during one forward+backward, above what was held before it (inputs, leaf).

    CUDA: ``max_memory_allocated`` minus ``memory_allocated`` before the call (caching-allocator blocks in use).
    CPU: torch.profiler with ``profile_memory=True`` records every allocation and free of torch's CPU allocator;
    the peak of their running sum, in time order, over the call.
    """
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        outputs = run_once(loss_fn, config, inputs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del outputs
        return peak
    from torch.profiler import ProfilerActivity, profile

    log_prob = inputs.log_prob.detach().requires_grad_(True)  # the leaf exists before the window, as inputs do
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        outputs = run_once(loss_fn, config, inputs, log_prob)
        del outputs
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="responses per call (B)")
    parser.add_argument("--length", type=int, default=8192, help="padded response length (T)")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds; each runs every loss once")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="of the log-probs")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    import verl
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    # Registers respo/vespo even where the verl.plugins entry point was not loaded; binds respo_verl too.
    import respo_verl.verl.losses

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked but torch.cuda.is_available() is False")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    inputs = make_inputs(args.batch, args.length, dtype, device, args.seed)
    # Each preset's registered loss, the reference first; (loss name, preset) pairs.
    presets = sorted(algorithms.ALGORITHMS, key=lambda a: a != REFERENCE_PRESET)
    preset_configs = {preset: actor_config(preset) for preset in presets}
    losses = [(preset_configs[p].policy_loss.loss_mode, p) for p in presets]
    reference = losses[0][0]
    names = [name for name, _ in losses]
    loss_fns = {name: get_policy_loss_fn(name) for name in names}
    configs = {}
    for name, algorithm in losses:
        config = preset_configs[algorithm]
        # As the engine sets it before ppo_loss (verl.workers.utils.losses.ppo_loss): one rank, whole batch.
        config.global_batch_info.update(
            dp_size=1,
            batch_num_tokens=inputs.n_tokens,
            global_batch_size=args.batch,
            loss_scale_factor=config.loss_scale_factor,
        )
        configs[name] = config

    load_before = os.getloadavg()
    for _ in range(args.warmup):
        for name in names:
            timed_call(loss_fns[name], configs[name], inputs, cuda)
    times: dict[str, list[float]] = {name: [] for name in names}
    wall_start = time.perf_counter()
    for r in range(args.repeats):
        gc.collect()
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed_call(loss_fns[name], configs[name], inputs, cuda))
    wall_s = time.perf_counter() - wall_start
    load_after = os.getloadavg()
    peaks = {name: peak_extra_bytes(loss_fns[name], configs[name], inputs, cuda) for name in names}

    ref_median = statistics.median(times[reference])
    results = {}
    for name in names:
        q1, median, q3 = quartiles(times[name])
        paired = [t / t_ref for t, t_ref in zip(times[name], times[reference])]
        p1, p_median, p3 = quartiles(paired)
        results[name] = {
            "preset": dict(losses)[name],
            "loss_agg_mode": configs[name].loss_agg_mode,
            "times_ms": [t * 1e3 for t in times[name]],
            "median_ms": median * 1e3,
            "iqr_ms": (q3 - q1) * 1e3,
            "ratio_of_medians": median / ref_median,
            "paired_ratio_median": p_median,
            "paired_ratio_iqr": [p1, p3],
            "peak_extra_mib": peaks[name] / MIB,
        }

    device_name = torch.cuda.get_device_name(device) if cuda else cpu_name()
    memory_note = (
        "torch.cuda.max_memory_allocated() during the call minus memory_allocated() before it"
        if cuda
        else "peak of the running sum of torch CPU-allocator allocations/frees recorded by "
        "torch.profiler(profile_memory=True) during one call (torch tensors only; no Python objects, no allocator "
        "slack)"
    )
    env = {
        "command": shlex.join(sys.orig_argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "verl": getattr(verl, "__version__", "?"),
        "respo_verl": respo_verl.__version__,
        "device": f"{args.device} ({device_name})",
        "torch_threads": torch.get_num_threads(),
        "os_cpu_count": os.cpu_count(),
        "loadavg_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
    }
    setup = {
        "batch": args.batch,
        "length": args.length,
        "valid_tokens": inputs.n_tokens,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "seed": args.seed,
        "timed_wall_s": wall_s,
    }

    print("## Policy-loss forward+backward benchmark\n")
    for key, value in env.items():
        print(f"- {key}: `{value}`")
    print(
        f"- inputs: B={args.batch}, T={args.length}, valid tokens={inputs.n_tokens} "
        f"(lengths ~ U[{max(args.length // 4, 1)}, {args.length}], seed {args.seed}), log-probs {args.dtype}, "
        "advantages fp32"
    )
    print(
        f"- timing: {args.warmup} warm-up + {args.repeats} interleaved rounds (order rotated per round), "
        f"forward+backward incl. metrics; timed wall {wall_s:.1f} s"
    )
    print(f"- peak extra memory: {memory_note}\n")
    print(
        "| loss | preset (loss_agg_mode) | median ms | IQR ms | ratio of medians | "
        f"ratio to {reference} (median of paired ratios) [IQR] | peak extra memory MB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, res in results.items():
        lo, hi = res["paired_ratio_iqr"]
        print(
            f"| {name} | {res['preset']} ({res['loss_agg_mode']}) | {res['median_ms']:.2f} | {res['iqr_ms']:.2f} | "
            f"{res['ratio_of_medians']:.3f} | {res['paired_ratio_median']:.3f} [{lo:.3f}, {hi:.3f}] | "
            f"{res['peak_extra_mib']:.1f} |"
        )
    target_name, target_ratio = TARGET
    achieved = results[target_name]["paired_ratio_median"]
    verdict = "met" if achieved <= target_ratio else "NOT met"
    print(
        f"\nTarget: {target_name} ≤ {target_ratio:.2f}× {reference} (median of paired ratios): "
        f"{achieved:.3f}× — {verdict}. (MB = 2^20 bytes.)"
    )

    target = {"loss": target_name, "max_ratio": target_ratio, "achieved": achieved, "met": achieved <= target_ratio}
    report = {"env": env, "setup": setup, "memory_measure": memory_note, "results": results, "target": target}
    write_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
