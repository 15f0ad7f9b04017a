#!/usr/bin/env bash
# A short check of this package on one GPU (docs/gpu.md, "Checking a GPU machine"): under five minutes, and it needs
# only torch, plus megatron-core (pure Python) for the MoE check. verl is optional: without it the verl-based
# benchmark is skipped with the reason printed.
#
#   scripts/gpu_check.sh [--device cuda|cpu] [--batch B] [--length T] [--python PY]
#
# One line per check: PASS|FAIL|SKIP <check>: <numbers>. Exit status 1 if any check failed.
# --device cpu runs the same checks on the CPU (small sizes), as a self-test of this script on a machine without a GPU.
# Wheels in .whl/ (or $GPU_CHECK_WHEELS), e.g. megatron-core 0.16.1 for CPython 3.12, are installed into a scratch
# folder first, for a GPU machine that cannot reach a package index.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEVICE=cuda
BATCH=""
LENGTH=""
PYTHON="${PYTHON:-python3}"

usage() {
    cat <<EOF
Usage: scripts/gpu_check.sh [--device cuda|cpu] [--batch B] [--length T] [--python PY]

  --device cuda|cpu   where to run (default cuda; cpu is a self-test with small sizes)
  --batch B           batch of the timing and benchmark checks (default 512 on cuda, 16 on cpu)
  --length T          response length of the timing and benchmark checks (default 16384 on cuda, 512 on cpu)
  --python PY         the interpreter (default: \$PYTHON or python3)
EOF
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
        --device | --batch | --length | --python)
            [[ $# -ge 2 ]] || { echo "gpu_check.sh: $1 needs a value" >&2; exit 2; }
            case "$1" in
                --device) DEVICE="$2" ;;
                --batch) BATCH="$2" ;;
                --length) LENGTH="$2" ;;
                --python) PYTHON="$2" ;;
            esac
            shift 2
            ;;
        *)
            echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2
            exit 2
            ;;
    esac
done
case "$DEVICE" in
    cuda) BATCH="${BATCH:-512}" LENGTH="${LENGTH:-16384}" ;;
    cpu) BATCH="${BATCH:-16}" LENGTH="${LENGTH:-512}" ;;
    *)
        echo "gpu_check.sh: unknown device '$DEVICE' (expected cuda or cpu)" >&2
        exit 2
        ;;
esac

SITE=""
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE="$(mktemp -d /tmp/gpu-check-site.XXXXXX)"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
fi
# The repository (respo_verl, with its tiny MoE model respo_verl.cpu.kit.megatron_moe), carried wheels first.
export PYTHONPATH="${SITE:+$SITE:}$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1

cd "$ROOT"
exec "$PYTHON" - "$DEVICE" "$BATCH" "$LENGTH" "$ROOT" <<'EOF'
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

DEVICE, BATCH, LENGTH, ROOT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
CUDA = DEVICE == "cuda"
DEV = torch.device(DEVICE)
# Tolerances against fp64 on the CPU. fp32 kernels: relative to 1 + |log φ| (log φ reaches −λ·e^20 at the clamp).
KERNEL_RTOL = 1e-5
# Loss terms from fp32 (bf16) inputs, upcast exactly to fp64 for the reference, so only arithmetic differs.
TERMS_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-4}
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # bf16: the gradient itself is stored in bf16
STATUS = []


def line(status: str, name: str, detail: str) -> None:
    STATUS.append(status)
    print(f"{status} {name}: {detail}", flush=True)


def check(name: str):
    """Run fn() -> (status, detail); an exception is a FAIL with its first line."""

    def run(fn):
        start = time.perf_counter()
        try:
            status, detail = fn()
        except Exception as exc:  # a check that breaks is a failed check, with the reason on its line
            status, detail = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            traceback.print_exc(file=sys.stderr)
        line(status, name, f"{detail} ({time.perf_counter() - start:.1f} s)")
        return fn

    return run


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


if CUDA and not torch.cuda.is_available():
    line("FAIL", "cuda", f"torch {torch.__version__}: torch.cuda.is_available() is False")
    sys.exit(1)
name = torch.cuda.get_device_name(0) if CUDA else "cpu"
print(f"# gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), device {DEVICE} ({name}), "
      f"python {sys.version.split()[0]}", flush=True)

from respo_verl.core import (KernelBranch, ReSPOConfig, VESPOConfig, respo_log_phi, respo_terms, vespo_log_phi,
                              vespo_terms)


@check("kernels")
def kernels():
    # The fp32 grid, upcast exactly for the reference: only the kernels' arithmetic is compared.
    grid = torch.linspace(-20.0, 20.0, 200_001, dtype=torch.float32)
    cfg = ReSPOConfig()
    branches = {"respo+": cfg.positive, "respo-": cfg.negative,
                "respo(a=1.001)": KernelBranch(1.001, 0.5, 2.0), "respo(a=3,b=0.2)": KernelBranch(3.0, 0.2, 0.5)}
    worst = {}
    for key, branch in branches.items():
        ref = respo_log_phi(grid.double(), branch)
        got = respo_log_phi(grid.to(DEV), branch).cpu().double()
        worst[key] = ((got - ref).abs() / (1 + ref.abs())).max().item()
    v = VESPOConfig()
    for key, (k, lam) in {"vespo+": (v.k_pos, v.lambda_pos), "vespo-": (v.k_neg, v.lambda_neg)}.items():
        ref = vespo_log_phi(grid.double(), k, lam)
        got = vespo_log_phi(grid.to(DEV), k, lam).cpu().double()
        worst[key] = ((got - ref).abs() / (1 + ref.abs())).max().item()
    top = max(worst.values())
    detail = f"max rel err of log phi (fp32 {DEVICE} vs fp64 cpu, {grid.numel()} points in [-20, 20]) {top:.2e} " + \
        " ".join(f"{k}={e:.1e}" for k, e in worst.items()) + f"; tol {KERNEL_RTOL:g}"
    return ("PASS" if top <= KERNEL_RTOL else "FAIL"), detail


def make_inputs(batch: int, length: int, seed: int, drift: float):
    """Right-padded responses (lengths ~ U[T/4, T]), log-probs around −1, new = old + drift·noise; a quarter of the
    rows shifted by ±25 in total so that the clamp at ±20 is exercised. fp32 on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    n_tok_seq = torch.randint(max(length // 4, 1), length + 1, (batch,), generator=gen)  # (B,)
    mask = torch.arange(length).unsqueeze(0) < n_tok_seq.unsqueeze(1)  # (B, T)
    old = torch.where(mask, -1.0 + 0.3 * torch.randn(batch, length, generator=gen), 0.0)  # (B, T)
    new = old + drift * torch.randn(batch, length, generator=gen)  # (B, T)
    shift_seq = torch.zeros(batch)
    shift_seq[: batch // 8] = 25.0
    shift_seq[batch // 8 : batch // 4] = -25.0
    new = torch.where(mask, new + (shift_seq / n_tok_seq).unsqueeze(1), 0.0)  # (B, T)
    adv = torch.randn(batch, generator=gen).unsqueeze(1) * mask  # (B, T)
    return new, old, adv, mask


def terms_and_grad(fn, config, new, old, adv, mask, device, dtype):
    leaf = new.detach().to(device=device, dtype=dtype, copy=True).requires_grad_(True)  # a fresh leaf
    t = fn(leaf, old.to(device=device, dtype=dtype), adv.to(device), mask.to(device), config)
    loss = t.loss_tok.sum() / mask.sum()
    loss.backward()
    return t, loss.detach(), leaf.grad


def loss_check(label, fn, config):
    @check(label)
    def run():
        new, old, adv, mask = make_inputs(64, 2048, seed=1, drift=0.01)
        parts, ok = [], True
        for dtype in (torch.float32, torch.bfloat16):
            # The reference sees exactly the values the device sees (rounded to dtype), in fp64.
            n, o = new.to(dtype).double(), old.to(dtype).double()
            ref, ref_loss, ref_grad = terms_and_grad(fn, config, n, o, adv.double(), mask, "cpu", torch.float64)
            got, got_loss, got_grad = terms_and_grad(fn, config, new, old, adv, mask, DEV, dtype)
            err_logw = (got.log_w_seq.cpu().double() - ref.log_w_seq).abs().max().item()
            err_phi = ((got.phi_seq.cpu().double() - ref.phi_seq).abs() / ref.phi_seq.abs().clamp(min=1e-30)).max()
            err_loss = abs(got_loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30)
            err_grad = (got_grad.cpu().double() - ref_grad).abs().max().item() / ref_grad.abs().max().item()
            clamp_same = torch.equal(got.clamped_seq.cpu(), ref.clamped_seq)
            tol = TERMS_TOL[dtype]
            ok &= err_logw <= tol * 20 and err_phi.item() <= tol and err_loss <= tol
            ok &= err_grad <= GRAD_TOL[dtype] and clamp_same
            parts.append(f"{str(dtype).removeprefix('torch.')}: logW {err_logw:.1e} phi {err_phi.item():.1e} "
                         f"loss {err_loss:.1e} grad {err_grad:.1e} clamp {'same' if clamp_same else 'DIFFERS'} "
                         f"({int(ref.clamped_seq.sum())} clamped)")
        return ("PASS" if ok else "FAIL"), f"B=64 T=2048 vs fp64 cpu; " + "; ".join(parts)


loss_check("respo-loss", respo_terms, ReSPOConfig())
loss_check("vespo-loss", vespo_terms, VESPOConfig())


@check("core-timing")
def core_timing():
    new, old, adv, mask = make_inputs(BATCH, LENGTH, seed=0, drift=0.01)
    new, old, adv, mask = new.to(DEV), old.to(DEV), adv.to(DEV), mask.to(DEV)
    config, n_tok = ReSPOConfig(), mask.sum()
    times = []
    for i in range(2 + 10):  # 2 warm-up calls
        leaf = new.detach().requires_grad_(True)
        sync()
        start = time.perf_counter()
        loss = respo_terms(leaf, old, adv, mask, config).loss_tok.sum() / n_tok
        loss.backward()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - start)
    if not torch.isfinite(loss):
        return "FAIL", "loss is not finite"
    memory = f", peak allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if CUDA else ""
    return "PASS", (f"respo_terms fwd+bwd B={BATCH} T={LENGTH} fp32 ({int(n_tok)} valid tokens): median "
                    f"{statistics.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f} ms over {len(times)}{memory}")


@check("bench-losses")
def bench_losses():
    # The installed distribution, not find_spec: tests/verl on the path is a namespace package named verl.
    try:
        importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return "SKIP", ("scripts/bench/losses.py needs verl (it takes the losses from verl's registry and composes "
                        "the presets with verl's configs); verl is not installed here")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench", "losses.py"), "--device", DEVICE,
               "--batch", str(BATCH), "--length", str(LENGTH), "--repeats", "5", "--warmup", "1", "--json", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            return "FAIL", f"exit {proc.returncode}: {tail[0]}"
        report = json.load(open(out))
    res = report["results"]
    times = " ".join(f"{k}={v['median_ms']:.2f}ms(x{v['paired_ratio_median']:.3f})" for k, v in res.items())
    target = report["target"]
    return "PASS", (f"B={BATCH} T={LENGTH} median fwd+bwd (paired ratio to vanilla): {times}; target "
                    f"{target['loss']} <= {target['max_ratio']}x: {'met' if target['met'] else 'NOT met'}")


@contextlib.contextmanager
def megatron_world():
    """megatron's model-parallel state (TP = PP = 1) on a world of one: NCCL on the GPU; on the CPU, the package's
    CPU patch of megatron-core with gloo (respo_verl/cpu/kit/megatron_moe.py, megatron_cpu)."""
    if not CUDA:
        from respo_verl.cpu.kit.megatron_moe import megatron_cpu

        with megatron_cpu():
            yield
        return
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    with tempfile.TemporaryDirectory() as tmp:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel(1, 1)
            tensor_parallel.model_parallel_cuda_manual_seed(0)
            try:
                yield
            finally:
                parallel_state.destroy_model_parallel()
        finally:
            dist.destroy_process_group()


@check("megatron-moe")
def megatron_moe():
    try:
        import megatron.core
    except Exception as exc:
        return "SKIP", f"megatron-core is not importable ({type(exc).__name__}: {exc}); carry its wheel in .whl/"
    from respo_verl.cpu.kit.megatron_moe import BATCH as B, NUM_EXPERTS, NUM_LAYERS, SEQ, VOCAB, tiny_gpt_moe

    from respo_verl.routing.megatron import RouteDriftMonitor, find_replay_routers

    tokens = B * SEQ

    def set_action(routers, action):
        for router in routers.values():
            enum = sys.modules[type(router.router_replay).__module__].RouterReplayAction
            router.router_replay.router_replay_action = None if action is None else enum[action]

    def forward(model, ids):
        batch, seq = ids.shape
        position_ids = torch.arange(seq, device=ids.device).expand(batch, seq)  # (B, T)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=ids.device), diagonal=1)[None, None]
        return model(ids, position_ids, attention_mask=causal)

    def replay(model, routers, ids, routes, grad):
        for layer, router in routers.items():
            router.router_replay.set_target_indices(routes[layer])
        set_action(routers, "REPLAY_FORWARD")
        with torch.set_grad_enabled(grad):
            logits = forward(model, ids)
            if grad:
                logits.float().square().mean().backward()
        for router in routers.values():
            router.router_replay.clear_indices()
        set_action(routers, None)
        return logits.detach()

    with megatron_world():
        model = tiny_gpt_moe().to(DEV)
        routers = find_replay_routers(model)
        ids = torch.randint(0, VOCAB, (B, SEQ), generator=torch.Generator().manual_seed(1)).to(DEV)
        set_action(routers, "RECORD")
        with torch.no_grad():
            native = forward(model, ids)
        set_action(routers, None)
        routes = {layer: r.router_replay.recorded_topk_idx.clone() for layer, r in routers.items()}
        with RouteDriftMonitor(model) as monitor:
            sync()
            start = time.perf_counter()
            with monitor.step():
                replayed = replay(model, routers, ids, routes, grad=True)
            sync()
            step_ms = (time.perf_counter() - start) * 1e3
            same = monitor.metrics()
            # One token's last expert on the last layer changed: nothing before it moves, so exactly one flip.
            last = NUM_LAYERS - 1
            flipped = {layer: idx.clone() for layer, idx in routes.items()}
            row = flipped[last][0]
            row[-1] = next(e for e in range(NUM_EXPERTS) if e not in row.tolist())
            with monitor.step():
                replay(model, routers, ids, flipped, grad=False)
            drift = monitor.metrics()
            # An expert index out of range on the last layer: a ValueError naming that layer, on the device too.
            bad = {layer: idx.clone() for layer, idx in routes.items()}
            bad[last][0, 0] = NUM_EXPERTS
            try:
                with monitor.step():
                    replay(model, routers, ids, bad, grad=False)
                refused = "no error"
            except ValueError as exc:
                refused = str(exc)
            for router in routers.values():
                router.router_replay.clear_indices()
            set_action(routers, None)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grads_finite = all(torch.isfinite(g).all() for g in grads)
        router_grad = min(r.weight.grad.norm().item() for r in routers.values())
        diff = (replayed - native).abs().max().item()
        ok = (diff <= 1e-5 and same["actor/routing/flip_frac"] == 0
              and same["actor/routing/replayed_tokens"] == tokens and grads_finite and router_grad > 0
              and abs(drift["actor/routing/any_layer_flip_frac"] - 1 / tokens) < 1e-12
              and abs(drift[f"actor/routing/flip_frac/layer_{last}"] - 1 / tokens) < 1e-12
              and refused.startswith(f"routing replay: layer {last}: ") and f"outside [0, {NUM_EXPERTS})" in refused)
        return ("PASS" if ok else "FAIL"), (
            f"megatron-core {megatron.core.__version__}, {NUM_LAYERS} MoE layers x {NUM_EXPERTS} experts, "
            f"{tokens} tokens: record->replay max |dlogits| {diff:.1e}, flip_frac {same['actor/routing/flip_frac']}, "
            f"replayed {same['actor/routing/replayed_tokens']:.0f}, {len(grads)} grads finite={grads_finite}, "
            f"min router grad norm {router_grad:.2e}; one forced flip -> any_layer_flip_frac "
            f"{drift['actor/routing/any_layer_flip_frac']:.4f} (expect {1 / tokens:.4f}); "
            f"bad expert index -> {refused!r}; replay fwd+bwd {step_ms:.1f} ms")


deep_ep = importlib.util.find_spec("deep_ep") is not None
line("SKIP", "megatron-moe-deepep", f"megatron-core's flex dispatcher asserts TP x EP > 1, i.e. at least two GPUs; "
     f"deep_ep importable here: {'yes' if deep_ep else 'no'}")

failed = STATUS.count("FAIL")
print(f"# gpu_check: {STATUS.count('PASS')} PASS, {failed} FAIL, {STATUS.count('SKIP')} SKIP", flush=True)
sys.exit(1 if failed else 0)
EOF
