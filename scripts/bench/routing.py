"""Forward+backward cost of MoE routing replay, with and without route-drift diagnostics.

Two tiny MoE models whose routing mirrors Qwen3-30B-A3B (softmax router, top-k with renormalised probabilities,
every layer MoE), each timed under three conditions:

- ``no_replay``: native routing, nothing installed (HF: no :class:`~respo_verl.routing.hf.RoutingReplay` on the
  model; Megatron: a second GPTModel with the same weights built with ``moe_enable_routing_replay=False``);
- ``replay``: routes forced, diagnostics off (HF: ``RoutingReplay(model, diagnostics=False)``; Megatron:
  megatron-core's native ``REPLAY_FORWARD`` with no :class:`~respo_verl.routing.megatron.RouteDriftMonitor`);
- ``replay_diag``: routes forced with route-drift diagnostics on (HF: ``RoutingReplay(model, diagnostics=True)``;
  Megatron: the same native replay with a ``RouteDriftMonitor`` installed), reading the ``actor/routing/...`` metrics
  once per call as a training step would.

The replayed routes are recorded from the same model on the same inputs (no optimiser step), so the drift is 0 and
the replay reproduces the native loss; ``--perturb F`` instead flips the last expert of a fraction ``F`` of the
tokens in every layer (same routes for both replay conditions), so the diagnostics count real flips.

The timed window of one call: enter the replay (HF: ``replay()`` with its input validation; Megatron: set the replay
targets and action; with diagnostics: ``monitor.step()``), forward, cross-entropy loss on next-token targets,
backward, and for ``replay_diag`` the metrics read. Installing / removing hooks, zeroing gradients and clearing the
replay state happen outside it. Timing is interleaved in one process: every repeat runs each condition once, in an
order rotated per repeat, so slow phases of a shared machine hit all conditions alike; the per-repeat (paired)
ratios ``replay_diag / replay`` (target ≤ 1.05) and ``replay / no_replay`` are the robust numbers.

Megatron runs on CPU through :func:`respo_verl.cpu.kit.megatron_moe.megatron_cpu`: the version-keyed patch
``respo_verl/patches/megatron_core_0_16_1.py`` neutralises megatron-core's hard-coded CUDA calls (current
device, streams, events, the CUDA RNG tracker), and a gloo world of size 1 runs with TP = PP = 1; every megatron
code path runs as written.

Usage (quick check, then the default sizes)::

    .venv/bin/python scripts/bench/routing.py --batch 2 --seq 128 --repeats 3
    .venv/bin/python scripts/bench/routing.py --json bench_routing.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

import torch
import torch.nn.functional as F
from common import cpu_name, quartiles, write_json

CONDITIONS = ("no_replay", "replay", "replay_diag")
MODELS = ("hf", "megatron")
MODEL_TITLES = {"hf": "HF transformers Qwen3-MoE", "megatron": "megatron-core GPTModel MoE"}
# Acceptance target: diagnostics may cost at most 5 % over replay alone (median of paired ratios).
TARGET_RATIO = 1.05


def flip_routes(topk_idx: torch.Tensor, fraction: float, num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """Replace the last expert of a random ``fraction`` of the tokens by another expert outside their set.

    Args:
        topk_idx: (tokens, k) distinct expert indices per token.
        fraction: share of tokens to flip, in [0, 1].
        num_experts: experts of the layer (> k).
        generator: source of the token choice.

    Returns:
        (tokens, k) int64 routes; the flipped tokens differ from ``topk_idx`` in exactly one expert.
    """
    routes = topk_idx.clone().long()
    tokens = routes.shape[0]
    chosen = torch.randperm(tokens, generator=generator)[: round(fraction * tokens)]  # (n,)
    if chosen.numel() == 0:
        return routes
    current = routes[chosen]  # (n, k)
    replacement = current[:, -1].clone()  # (n,)
    pending = torch.ones_like(replacement, dtype=torch.bool)  # (n,)
    for shift in range(1, num_experts):
        candidate = (current[:, -1] + shift) % num_experts  # (n,)
        free = ~(candidate.unsqueeze(-1) == current).any(dim=-1)  # (n,)
        take = pending & free
        replacement[take] = candidate[take]
        pending &= ~take
    routes[chosen, -1] = replacement
    return routes


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (batch, seq, vocab) against the next tokens of ``input_ids`` (batch, seq)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), input_ids[:, 1:].reshape(-1))


class HFBench:
    """A tiny transformers ``Qwen3MoeForCausalLM`` under the three conditions.

    Args:
        args: parsed command line (sizes, seed, perturbation).
    """

    def __init__(self, args: argparse.Namespace):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        from respo_verl.routing.hf import RoutingReplay

        self._replay_cls = RoutingReplay
        config = Qwen3MoeConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            moe_intermediate_size=args.moe_ffn, num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=max(args.heads // 2, 1), head_dim=args.hidden // args.heads,
            num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True, decoder_sparse_step=1,
            max_position_embeddings=max(args.seq, 64), tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(args.seed)
        self.model = Qwen3MoeForCausalLM(config).float().train()
        gen = torch.Generator().manual_seed(args.seed + 1)
        self.input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)  # (B, T)
        with self._replay_cls(self.model) as recorder, torch.no_grad(), recorder.record() as routes:
            self.model(self.input_ids)
        flip_gen = torch.Generator().manual_seed(args.seed + 2)
        self.routes = {
            layer: flip_routes(idx, args.perturb, args.experts, flip_gen) for layer, idx in sorted(routes.items())
        }
        self.setup = {
            "config": (
                f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads / {config.num_key_value_heads} KV, "
                f"{args.experts} experts top-{args.top_k} (moe_ffn {args.moe_ffn}), vocab {args.vocab}, fp32, "
                f"attn={config._attn_implementation}, experts={getattr(config, '_experts_implementation', '?')}"
            ),
        }

    def call(self, condition: str) -> tuple[float, float, dict[str, float] | None]:
        """One forward+backward under ``condition``.

        Returns:
            (seconds in the timed window, loss, diagnostics metrics or None).
        """
        self.model.zero_grad(set_to_none=True)
        replay = None
        if condition != "no_replay":
            replay = self._replay_cls(self.model, diagnostics=condition == "replay_diag")
        try:
            start = time.perf_counter()
            context = contextlib.nullcontext() if replay is None else replay.replay(self.routes)
            with context:
                loss = next_token_loss(self.model(self.input_ids).logits, self.input_ids)
                loss.backward()
            metrics = replay.diagnostics() if condition == "replay_diag" else None
            elapsed = time.perf_counter() - start
        finally:
            if replay is not None:
                replay.remove()
        return elapsed, loss.item(), metrics

    @contextlib.contextmanager
    def session(self) -> Iterator[HFBench]:
        """Nothing to set up: the HF model runs on CPU as it is."""
        yield self


class MegatronBench:
    """A tiny megatron-core ``GPTModel`` MoE (local layer spec, alltoall dispatcher) under the three conditions.

    Must be built and run inside :meth:`session` (megatron-core's CPU patch and a gloo world of size 1).

    Args:
        args: parsed command line (sizes, seed, perturbation).
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.setup = {
            "config": (
                f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads / {max(args.heads // 2, 1)} "
                f"query groups, {args.experts} experts top-{args.top_k} (moe_ffn {args.moe_ffn}), vocab {args.vocab}, "
                "fp32, local spec, alltoall dispatcher, softmax router (top-k on logits, softmax over the k)"
            ),
        }

    @contextlib.contextmanager
    def session(self) -> Iterator[MegatronBench]:
        """Apply megatron-core's CPU patch, build both models, record the routes; restore everything on exit."""
        from respo_verl.cpu.kit import megatron_moe as cpu

        with cpu.megatron_cpu():
            self._build(cpu)
            try:
                yield self
            finally:
                for router in self.routers.values():
                    router.router_replay.clear_indices()
                    router.router_replay.router_replay_action = None
                del self.model_on, self.model_off, self.routers

    def _build(self, cpu: Any) -> None:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        from respo_verl.routing.megatron import RouteDriftMonitor, find_replay_routers

        args = self.args
        self._actions, self._monitor_cls = RouterReplayAction, RouteDriftMonitor
        spec = get_gpt_layer_local_spec(num_experts=args.experts, qk_layernorm=True, normalization="RMSNorm")
        models = []
        for replay_on in (True, False):
            config = cpu.tiny_config(
                num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=2 * args.hidden,
                num_attention_heads=args.heads, num_query_groups=max(args.heads // 2, 1),
                kv_channels=args.hidden // args.heads, num_moe_experts=args.experts, moe_router_topk=args.top_k,
                moe_ffn_hidden_size=args.moe_ffn, init_method_std=0.02, moe_enable_routing_replay=replay_on,
            )  # fmt: skip
            torch.manual_seed(args.seed)
            models.append(
                GPTModel(
                    config, spec, vocab_size=args.vocab, max_sequence_length=args.seq, position_embedding_type="rope"
                ).train()
            )
        self.model_on, self.model_off = models
        for (name, p_on), p_off in zip(self.model_on.named_parameters(), self.model_off.parameters(), strict=True):
            if not torch.equal(p_on, p_off):
                raise RuntimeError(f"the replay-on and replay-off GPTModels differ at {name}")
        gen = torch.Generator().manual_seed(args.seed + 1)
        self.input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)  # (B, T)
        self.position_ids = torch.arange(args.seq).expand(args.batch, args.seq)  # (B, T)
        # True = masked; megatron would build its default causal mask on CUDA.
        self.causal_mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), diagonal=1)[None, None]
        self.routers = find_replay_routers(self.model_on)
        self._set_action(self._actions.RECORD)
        with torch.no_grad():
            self._forward(self.model_on)
        self._set_action(None)
        flip_gen = torch.Generator().manual_seed(args.seed + 2)
        self.routes = {
            layer: flip_routes(router.router_replay.recorded_topk_idx, args.perturb, args.experts, flip_gen)
            for layer, router in sorted(self.routers.items())
        }
        for router in self.routers.values():
            router.router_replay.clear_indices()

    def _forward(self, model: torch.nn.Module) -> torch.Tensor:
        return model(self.input_ids, self.position_ids, attention_mask=self.causal_mask)  # (B, T, vocab)

    def _set_action(self, action: Any) -> None:
        for router in self.routers.values():
            router.router_replay.router_replay_action = action

    def _start_replay(self) -> None:
        for layer, router in self.routers.items():
            router.router_replay.set_target_indices(self.routes[layer])
            router.router_replay.router_replay_action = self._actions.REPLAY_FORWARD

    def call(self, condition: str) -> tuple[float, float, dict[str, float] | None]:
        """One forward+backward under ``condition``.

        Returns:
            (seconds in the timed window, loss, diagnostics metrics or None).
        """
        model = self.model_off if condition == "no_replay" else self.model_on
        model.zero_grad(set_to_none=True)
        monitor = self._monitor_cls(self.model_on) if condition == "replay_diag" else None
        metrics = None
        try:
            start = time.perf_counter()
            if monitor is None:
                if condition == "replay":
                    self._start_replay()
                loss = next_token_loss(self._forward(model), self.input_ids)
                loss.backward()
            else:
                with monitor.step():
                    self._start_replay()
                    loss = next_token_loss(self._forward(model), self.input_ids)
                    loss.backward()
                metrics = monitor.metrics()
            elapsed = time.perf_counter() - start
        finally:
            for router in self.routers.values():
                router.router_replay.clear_indices()
                router.router_replay.router_replay_action = None
            if monitor is not None:
                monitor.remove()
        return elapsed, loss.item(), metrics


def version(dist: str) -> str:
    """Installed version of distribution ``dist`` ("absent" if not installed)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def run_interleaved(call: Callable[[str], tuple[float, float, Any]], warmup: int, repeats: int) -> dict[str, Any]:
    """Warm up, then time ``repeats`` rounds, each running every condition once in a rotated order.

    Returns:
        ``{"times": {condition: [s, ...]}, "losses": {condition: loss}, "metrics": last diagnostics, "wall_s": s}``.
    """
    for _ in range(warmup):
        for condition in CONDITIONS:
            call(condition)
    times: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    losses: dict[str, float] = {}
    metrics = None
    wall_start = time.perf_counter()
    for r in range(repeats):
        gc.collect()
        shift = r % len(CONDITIONS)
        for condition in CONDITIONS[shift:] + CONDITIONS[:shift]:
            elapsed, loss, cond_metrics = call(condition)
            times[condition].append(elapsed)
            losses[condition] = loss
            if cond_metrics is not None:
                metrics = cond_metrics
    return {"times": times, "losses": losses, "metrics": metrics, "wall_s": time.perf_counter() - wall_start}


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """Median / IQR per condition and the paired per-repeat ratios of one model."""
    times = raw["times"]
    conditions = {}
    for condition in CONDITIONS:
        q1, median, q3 = quartiles(times[condition])
        conditions[condition] = {
            "times_ms": [t * 1e3 for t in times[condition]],
            "median_ms": median * 1e3,
            "iqr_ms": (q3 - q1) * 1e3,
            "loss": raw["losses"][condition],
        }
    ratios = {}
    pairs = {"diag_over_replay": ("replay_diag", "replay"), "replay_over_none": ("replay", "no_replay")}
    for name, (num, den) in pairs.items():
        paired = [a / b for a, b in zip(times[num], times[den], strict=True)]
        p1, p_median, p3 = quartiles(paired)
        delta_ms = statistics.median([(a - b) * 1e3 for a, b in zip(times[num], times[den], strict=True)])
        ratios[name] = {"paired": paired, "median": p_median, "iqr": [p1, p3], "median_delta_ms": delta_ms}
    metrics = raw["metrics"] or {}
    drift = {key.rsplit("/", 1)[-1]: metrics[key] for key in metrics if key.count("/") == 2}
    return {"conditions": conditions, "ratios": ratios, "drift": drift, "timed_wall_s": raw["wall_s"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: hf,megatron")
    parser.add_argument("--batch", type=int, default=4, help="sequences per forward (B)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence (T); tokens per forward = B*T")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers, every one MoE")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (KV heads / query groups: half)")
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--moe-ffn", type=int, default=256, help="expert FFN hidden size")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    parser.add_argument("--perturb", type=float, default=0.0, help="fraction of tokens whose replayed route flips")
    parser.add_argument("--repeats", type=int, default=12, help="timed rounds; each runs every condition once")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown or not args.models:
        parser.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    if not 0.0 <= args.perturb <= 1.0:
        parser.error("--perturb must be in [0, 1]")
    if args.repeats < 1 or args.warmup < 0 or args.hidden % args.heads or args.top_k >= args.experts:
        parser.error("need repeats >= 1, warmup >= 0, hidden divisible by heads, top-k < experts")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the Markdown report and return it as a dict."""
    args = parse_args(argv)
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import respo_verl

    torch.set_num_threads(args.threads)
    benches = {"hf": HFBench, "megatron": MegatronBench}
    load_before = os.getloadavg()
    results, setups = {}, {}
    for name in args.models:
        bench = benches[name](args)
        with bench.session():
            results[name] = summarise(run_interleaved(bench.call, args.warmup, args.repeats))
        setups[name] = bench.setup
        del bench
        gc.collect()
    load_after = os.getloadavg()

    env = {
        "command": shlex.join(sys.orig_argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "megatron-core": version("megatron-core"),
        "verl": version("verl"),
        "respo_verl": respo_verl.__version__,
        "device": f"cpu ({cpu_name()})",
        "torch_threads": torch.get_num_threads(),
        "os_cpu_count": os.cpu_count(),
        "loadavg_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
    }
    tokens = args.batch * args.seq
    print("## Routing-replay forward+backward benchmark\n")
    for key, value in env.items():
        print(f"- {key}: `{value}`")
    print(f"- inputs: B={args.batch}, T={args.seq} ({tokens} tokens per forward), seed {args.seed}")
    print(
        f"- replayed routes: recorded from the same model on the same inputs, "
        f"{'unperturbed (drift 0)' if args.perturb == 0 else f'last expert flipped for {args.perturb:.0%} of tokens'}"
    )
    print(
        f"- timing: {args.warmup} warm-up + {args.repeats} interleaved rounds (order rotated per round), "
        "forward + next-token CE + backward (+ metrics read for replay_diag)"
    )
    for name in args.models:
        print(f"- {name}: {setups[name]['config']}; timed wall {results[name]['timed_wall_s']:.1f} s")
    print(
        "\n| model | condition | median ms | IQR ms | loss | paired ratio [IQR] | paired Δ ms |\n"
        "|---|---|---:|---:|---:|---:|---:|",
    )
    for name in args.models:
        res = results[name]
        for condition in CONDITIONS:
            cond = res["conditions"][condition]
            if condition == "no_replay":
                ratio = delta = "—"
            else:
                key, label = (
                    ("replay_over_none", "/ no_replay") if condition == "replay" else ("diag_over_replay", "/ replay")
                )
                r = res["ratios"][key]
                ratio = f"{r['median']:.3f} {label} [{r['iqr'][0]:.3f}, {r['iqr'][1]:.3f}]"
                delta = f"{r['median_delta_ms']:+.2f}"
            print(
                f"| {name} | {condition} | {cond['median_ms']:.1f} | {cond['iqr_ms']:.1f} | {cond['loss']:.6f} | "
                f"{ratio} | {delta} |"
            )
    print("\nRoute drift measured by replay_diag (last call):\n")
    print("| model | flip_frac | overlap | prob_mass_delta | any_layer_flip_frac | replayed_tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models:
        d = results[name]["drift"]
        print(
            f"| {name} | {d.get('flip_frac', float('nan')):.4f} | {d.get('overlap', float('nan')):.4f} | "
            f"{d.get('prob_mass_delta', float('nan')):.2e} | {d.get('any_layer_flip_frac', float('nan')):.4f} | "
            f"{d.get('replayed_tokens', float('nan')):.0f} |"
        )
    target = {}
    print()
    for name in args.models:
        achieved = results[name]["ratios"]["diag_over_replay"]["median"]
        met = achieved <= TARGET_RATIO
        target[name] = {"max_ratio": TARGET_RATIO, "achieved": achieved, "met": met}
        print(
            f"Target ({name}): replay_diag ≤ {TARGET_RATIO:.2f}× replay (median of paired ratios): "
            f"{achieved:.3f}× — {'met' if met else 'NOT met'}."
        )

    setup = {k: v for k, v in vars(args).items() if k != "json"} | {"tokens": tokens}
    report = {"env": env, "setup": setup, "models": setups, "results": results, "target": target}
    write_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
