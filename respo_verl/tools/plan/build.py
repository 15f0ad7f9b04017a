"""``respo-verl plan PRESET --build``: megatron-core builds the preset's model and optimizer on the meta device.

One process per rank (spawned, two at a time by default), each a rank of a world of the preset's size under torch's
``fake`` process-group backend (collectives do nothing), runs the steps of verl 0.9.1's Megatron engine that a GPU
run takes before its first batch: ``MegatronEngine.__init__`` (``initialize_model_parallel`` with the engine's
arguments), ``_build_tf_config`` (mbridge's ``AutoBridge.from_config`` and ``set_extra_args``), verl's
``make_megatron_module`` with the engine's wrap and DDP settings (``_resolve_override_ddp_config``), and
``_build_optimizer`` (``init_megatron_optim_config``, ``get_megatron_optimizer``). Weights are not loaded (there
are none); the model is built on the meta device, so no memory is allocated for it. The stand-ins this needs on a
machine without Transformer Engine, DeepEP and CUDA are :mod:`respo_verl.patches.meta_build`, applied in the rank's
process for the build only.

What a rank reports is counted from the tensors megatron made: dense and expert parameters per model chunk
(expert parameters are those megatron marks ``allreduce=False``), the DDP buffers (``param_data``, ``grad_data``,
their padded and unpadded sizes), and the distributed optimizer's shards (fp32 main parameters, Adam's two moments
as megatron's own ``init_state_fn`` creates them; for megatron's CPU optimizer, its fp32 copies, the moments
following at its first step). :func:`compare` holds them against the planner's per-rank figures
(:func:`respo_verl.tools.plan.memory.megatron_rank_figures`).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import resource
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from respo_verl.layout.models import ModelShape
from respo_verl.layout.parallel import Layout
from respo_verl.tools.plan.memory import megatron_rank_figures

# Default parallelism of the build: the machine's cores (each rank is one process of ~0.7 GiB).
DEFAULT_WORKERS = max(1, min(2, os.cpu_count() or 1))
# A rank that takes longer than this is stuck, not slow (docs/internals.md, "The planner's start-up time").
RANK_TIMEOUT_S = 600

# The stage of a failure that is bad input (the model config); a failure at any other stage of the engine's
# start-up (engine config, parallel state, transformer config, model, optimizer) is a refusal of the layout.
MODEL_CONFIG_STAGE = "model config"


class BuildInputError(ValueError):
    """Bad input for a build (ranks outside the world, a model config the bridge cannot build)."""


@dataclass(frozen=True)
class BuildRequest:
    """What one rank's process needs; plain data, so that it crosses a spawn."""

    preset: str
    rank: int
    world: int
    hf_config: dict
    actor: dict  # the composed job's actor_rollout_ref.actor, resolved (the rank does not compose again)


@dataclass
class RankResult:
    """One rank's build, or the stage and message of its failure."""

    request: BuildRequest
    ok: bool
    stage: str = ""
    error: str = ""
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0
    peak_rss_mib: float = 0.0


def hf_config_from_shape(shape: ModelShape) -> dict:
    """A HuggingFace ``config.json`` for a shipped architecture, written from the planner's own shape.

    Every shape field is set explicitly: transformers' ``Qwen3MoeConfig`` defaults differ from the published
    Qwen3-30B-A3B in the layer count, positions, ``norm_topk_prob`` and (in transformers 5) ``head_dim``, which
    it derives as hidden / heads = 64 where the model has 128.
    """
    cfg = {
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "intermediate_size": shape.ffn_hidden_size,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "bfloat16",
    }
    if shape.is_moe:
        cfg |= {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": shape.num_experts,
            "num_experts_per_tok": shape.moe_topk,
            "moe_intermediate_size": shape.moe_ffn_hidden_size,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    else:
        cfg |= {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    return cfg


def actor_config(preset: str, overrides: tuple[str, ...] | list[str] = (), algorithm: str = "respo") -> dict:
    """The composed job's ``actor_rollout_ref.actor``, resolved to plain data for the rank processes."""
    from omegaconf import OmegaConf

    from respo_verl.tools.plan.presets import compose_preset

    cfg = compose_preset(preset, overrides, algorithm=algorithm)
    return OmegaConf.to_container(cfg.actor_rollout_ref.actor, resolve=True)


def default_ranks(lay: Layout) -> list[int]:
    """The first, a middle and the last rank, and the first rank of every pipeline stage.

    megatron orders ranks tp-cp-ep-dp-pp (pipeline outermost), so stage s holds ranks [s·W/PP, (s+1)·W/PP); every
    rank of a stage holds the same shard shapes (heads, experts and vocabulary divide evenly, which the rules check).
    """
    per_stage = lay.world // lay.pp
    ranks = {0, lay.world // 2, lay.world - 1} | {s * per_stage for s in range(lay.pp)}
    return sorted(ranks)


_RANK_OR_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_ranks(text: str, world: int) -> list[int]:
    """``--ranks 0,7,12-15`` as a sorted list; every rank must be in [0, world)."""
    ranks: set[int] = set()
    for part in text.split(","):
        match = _RANK_OR_RANGE.match(part.strip())
        if match is None:
            raise BuildInputError(f"--ranks {text!r}: {part.strip()!r} is not a rank or a range a-b")
        lo = int(match.group(1))
        ranks.update(range(lo, int(match.group(2) or lo) + 1))
    outside = sorted(r for r in ranks if not 0 <= r < world)
    if outside or not ranks:
        raise BuildInputError(f"--ranks {text!r}: rank(s) {outside} outside the world of {world} (0..{world - 1})")
    return sorted(ranks)


# ---- in the rank's process ----------------------------------------------------------------------------------------


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text.split(" when instantiating ")[0]


def _buffer_figures(buffers) -> dict:
    out = {"numel": 0, "numel_unpadded": 0, "param_bytes": 0, "grad_bytes": 0, "param_dtype": "", "grad_dtype": ""}
    for buf in buffers:
        out["numel"] += buf.numel
        out["numel_unpadded"] += buf.numel_unpadded
        if buf.param_data is not None:
            out["param_bytes"] += buf.param_data.numel() * buf.param_data.element_size()
            out["param_dtype"] = str(buf.param_data.dtype).removeprefix("torch.")
        out["grad_bytes"] += buf.grad_data.numel() * buf.grad_data.element_size()
        out["grad_dtype"] = str(buf.grad_data.dtype).removeprefix("torch.")
    return out


def _is_expert(param) -> bool:
    return getattr(param, "allreduce", True) is False


def _optimizer_figures(optimizer) -> dict:
    """Main parameters and Adam states per kind (dense / expert), counted from the optimizer megatron built."""
    out = {kind: {"main_params": 0, "states": 0, "state_bytes": 0, "where": "", "states_created": True}
           for kind in ("dense", "expert")}  # fmt: skip
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [p for group in opt.model_float16_groups + opt.model_fp32_groups for p in group]
        if not params:
            continue
        kind = "expert" if _is_expert(params[0]) else "dense"
        inner = opt.optimizer
        fp32_copies = getattr(inner, "param_to_fp32_param", None)
        if fp32_copies is not None:  # megatron's HybridDeviceOptimizer (optimizer_cpu_offload)
            mains = list(fp32_copies.values())
            out[kind]["where"] = f"host (CPU optimizer, fraction {inner.offload_fraction:g})"
            out[kind]["states_created"] = False  # torch's Adam creates its moments at the first step
        else:
            mains = [p for group in opt.shard_fp32_from_float16_groups + opt.shard_fp32_groups for p in group]
            out[kind]["where"] = "GPU"
            if opt.init_state_fn is not None:
                opt.init_state_fn(inner, opt.config)  # megatron's own, as for a checkpoint load
        out[kind]["main_params"] += sum(p.numel() for p in mains if p is not None)
        for state in inner.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                if name in state:
                    out[kind]["states"] += state[name].numel()
                    out[kind]["state_bytes"] += state[name].numel() * state[name].element_size()
    return out


def _layout_of_rank() -> dict:
    from megatron.core import parallel_state as mpu

    return {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "tp_rank": mpu.get_tensor_model_parallel_rank(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "pp_rank": mpu.get_pipeline_model_parallel_rank(),
        "vpp": mpu.get_virtual_pipeline_model_parallel_world_size(),
        "cp": mpu.get_context_parallel_world_size(),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "ep_rank": mpu.get_expert_model_parallel_rank(),
        "etp": mpu.get_expert_tensor_parallel_world_size(),
        "dp": mpu.get_data_parallel_world_size(),
        "dp_rank": mpu.get_data_parallel_rank(),
        "expert_dp": mpu.get_expert_data_parallel_world_size(),
    }


def build_rank(request: BuildRequest) -> RankResult:
    """Build rank ``request.rank`` in this process (a fresh one: the stand-ins and the process group are global)."""
    start = time.perf_counter()
    stage = "imports"
    result = RankResult(request=request, ok=False)
    try:
        import torch.distributed as dist
        from omegaconf import OmegaConf
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from verl.utils.config import omega_conf_to_dataclass

        from respo_verl.patches import meta_build

        stage = "engine config"
        actor = OmegaConf.create(request.actor)
        engine_config = omega_conf_to_dataclass(actor.megatron)
        optimizer_config = omega_conf_to_dataclass(actor.optim)
        checkpoint_config = omega_conf_to_dataclass(actor.checkpoint)
        with contextlib.ExitStack() as stack:
            stage = MODEL_CONFIG_STAGE
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="respo-verl-build-"))
            Path(folder, "config.json").write_text(json.dumps(request.hf_config))
            from verl.workers.config import HFModelConfig

            model_config = HFModelConfig(path=folder, load_tokenizer=False)
            from verl.models.mcore.mbridge import AutoBridge

            model_type = getattr(model_config.hf_config, "model_type", None)
            if model_type not in AutoBridge.list_supported_models():
                raise ValueError(f"mbridge has no bridge for model_type {model_type!r}")
            stage = "parallel state"
            dist.init_process_group("fake", store=FakeStore(), rank=request.rank, world_size=request.world)
            stack.callback(dist.destroy_process_group)
            for patch in (meta_build.MEGATRON, meta_build.MBRIDGE):
                if patch.apply():
                    stack.callback(patch.remove)
            from megatron.core import parallel_state as mpu
            from verl.utils.megatron.optimizer import is_muon_layer_wise_config
            from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module
            from verl.workers.engine.megatron.transformer_impl import MegatronEngine

            engine = MegatronEngine(model_config, engine_config, optimizer_config, checkpoint_config)
            stack.callback(mpu.destroy_model_parallel)
            stage = "transformer config"
            engine._build_tf_config()
            stage = "model"
            # MegatronEngine._build_megatron_module without its weight loading (there are no weights).
            wrap_config = McoreModuleWrapperConfig(
                is_value_model=engine.is_value_model,
                wrap_with_ddp=not engine_config.forward_only,
                use_distributed_optimizer=engine_config.use_distributed_optimizer,
                use_layer_wise_distributed_optimizer=is_muon_layer_wise_config(optimizer_config),
                use_megatron_fsdp=engine_config.use_megatron_fsdp,
            )
            engine.module, engine.tf_config = make_megatron_module(
                wrap_config=wrap_config,
                tf_config=engine.tf_config,
                hf_config=model_config.hf_config,
                bridge=engine.bridge,
                provider=engine.provider,
                override_model_config=engine_config.override_mcore_model_config,
                override_ddp_config=engine._resolve_override_ddp_config(),
                peft_cls=engine.peft_cls,
                peft_config=None,
            )
            stage = "optimizer"
            optimizer = engine._build_optimizer()
            chunks = []
            for chunk in engine.module:
                params = list(chunk.parameters())
                chunks.append(
                    {
                        "dense_params": sum(p.numel() for p in params if not _is_expert(p)),
                        "expert_params": sum(p.numel() for p in params if _is_expert(p)),
                    }
                )
            figures = {
                "layout": _layout_of_rank(),
                "chunks": chunks,
                "ddp": {
                    "dense": _buffer_figures(b for c in engine.module for b in c.buffers),
                    "expert": _buffer_figures(b for c in engine.module for b in c.expert_parallel_buffers),
                },
                "optimizer": _optimizer_figures(optimizer),
            }
        result.ok, result.figures = True, figures
    except Exception as err:  # megatron's, mbridge's or verl's own refusal; reported in one line
        result.stage, result.error = stage, _one_line(err)
    result.seconds = time.perf_counter() - start
    result.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def _quiet_build_rank(request: BuildRequest) -> RankResult:
    """:func:`build_rank` with the libraries' prints and warnings sent to /dev/null (one report per rank)."""
    import warnings

    warnings.filterwarnings("ignore")
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        return build_rank(request)


def build_ranks(requests: list[BuildRequest], workers: int = DEFAULT_WORKERS) -> list[RankResult]:
    """Build each request in a fresh spawned process, ``workers`` at a time; results in the order of ``requests``."""
    env = {"HF_HUB_OFFLINE": "1", "TORCH_COMPILE_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=ctx, max_tasks_per_child=1) as pool:
            futures = [pool.submit(_quiet_build_rank, r) for r in requests]
            return [f.result(timeout=RANK_TIMEOUT_S) for f in futures]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- against the planner ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One figure of the build beside the planner's; ``tolerance`` is 0 where the planner is exact."""

    item: str
    build: int
    planner: int
    tolerance: int = 0

    @property
    def diff(self) -> int:
        return self.build - self.planner

    @property
    def ok(self) -> bool:
        return abs(self.diff) <= self.tolerance


def compare(model: ModelShape, lay: Layout, figures: dict) -> list[Check]:
    """The build's figures of one rank against the planner's for the same pipeline stage.

    Exact: parameters per model chunk (dense, expert), the DDP buffers' unpadded bytes (bf16 weights, fp32
    gradients), the optimizer's main parameters and Adam states where megatron created them without padding.
    Within megatron's padding: a rank's optimizer shard is a slice of the padded DDP buffer (buffer / DP), so it
    differs from the planner's unpadded share by at most that buffer group's padding, which the build reports.
    """
    pp_rank = figures["layout"]["pp_rank"]
    plan = megatron_rank_figures(model, lay, pp_rank)
    checks: list[Check] = []
    for i, (built, planned) in enumerate(zip(figures["chunks"], plan.chunks, strict=True)):
        checks.append(Check(f"chunk {i} dense params", built["dense_params"], planned.dense))
        checks.append(Check(f"chunk {i} expert params", built["expert_params"], planned.expert))
    for kind, planned_params, dp in (
        ("dense", plan.dense, lay.dp),
        ("expert", plan.expert, lay.expert_dp),
    ):
        ddp = figures["ddp"][kind]
        if not planned_params and not ddp["numel"]:
            continue
        unpadded = ddp["numel_unpadded"]
        param_size = ddp["param_bytes"] // ddp["numel"] if ddp["param_bytes"] else 0
        grad_size = ddp["grad_bytes"] // ddp["numel"]
        checks.append(Check(f"DDP {kind} weights (bytes)", unpadded * param_size, plan.weight_bytes(planned_params)))
        checks.append(Check(f"DDP {kind} grads (bytes)", unpadded * grad_size, plan.grad_bytes(planned_params)))
        opt = figures["optimizer"][kind]
        padding = ddp["numel"] - unpadded
        share = plan.optimizer_share(planned_params, dp)
        checks.append(Check(f"optimizer {kind} main params", opt["main_params"], share, padding))
        if opt["states_created"]:
            checks.append(Check(f"optimizer {kind} Adam states", opt["states"], 2 * share, 2 * padding))
    return checks


# ---- the command --------------------------------------------------------------------------------------------------

MG = "actor_rollout_ref.actor.megatron"


def _layout_keys(lay: Layout, overrides: tuple[str, ...]) -> str:
    """The megatron keys a refusal is about: those the user overrode, else the preset's parallel sizes."""
    given = [o.lstrip("+~") for o in overrides if o.lstrip("+~").startswith(f"{MG}.")]
    if given:
        return ", ".join(given)
    vpp = f" VPP {lay.vpp}" if lay.vpp else ""
    return f"{MG}: TP {lay.tp} PP {lay.pp}{vpp} CP {lay.cp} EP {lay.ep} ETP {lay.etp} on {lay.world} GPUs"


def _fmt_rank(preset: str, res: RankResult) -> str:
    lay = res.figures["layout"]
    vpp = f" VPP {lay['vpp']}" if lay["vpp"] else ""
    return (
        f"{preset} rank {res.request.rank} of {res.request.world}: TP {lay['tp']} (rank {lay['tp_rank']}) "
        f"PP {lay['pp']} (stage {lay['pp_rank']}){vpp} CP {lay['cp']} EP {lay['ep']} (rank {lay['ep_rank']}) "
        f"ETP {lay['etp']} DP {lay['dp']} expert DP {lay['expert_dp']}; built in {res.seconds:.1f} s, "
        f"peak RSS {res.peak_rss_mib:.0f} MiB"
    )


def rank_record(preset: str, res: RankResult, checks: list[Check]) -> dict:
    """The ``--json`` object of one built rank."""
    from respo_verl.patches.meta_build import DEVIATIONS

    chunks = res.figures["chunks"]
    return {
        "preset": preset,
        "rank": res.request.rank,
        "world": res.request.world,
        "dense_params": sum(c["dense_params"] for c in chunks),
        "expert_params": sum(c["expert_params"] for c in chunks),
        "layout": res.figures["layout"],
        "chunks": chunks,
        "ddp": res.figures["ddp"],
        "optimizer": res.figures["optimizer"],
        "checks": [
            {"item": c.item, "build": c.build, "planner": c.planner, "diff": c.diff, "tolerance": c.tolerance}
            | {"ok": c.ok}
            for c in checks
        ],
        "seconds": round(res.seconds, 2),
        "peak_rss_mib": round(res.peak_rss_mib, 1),
        "stand_ins": [name for name, _, _ in DEVIATIONS],
    }


def run_build(
    preset: str,
    overrides: tuple[str, ...],
    algorithm: str,
    model: ModelShape,
    lay: Layout,
    hf_config: dict,
    ranks: list[int],
    as_json: bool,
    workers: int,
    out,
    err,
) -> int:
    """Build ``ranks`` of ``preset`` and print them beside the planner; the exit status of ``--build``."""
    actor = actor_config(preset, overrides, algorithm)
    requests = [BuildRequest(preset, r, lay.world, hf_config, actor) for r in ranks]
    results = build_ranks(requests, workers=workers)
    return report_build(preset, overrides, model, lay, results, as_json, out, err)


def report_build(
    preset: str,
    overrides: tuple[str, ...],
    model: ModelShape,
    lay: Layout,
    results: list[RankResult],
    as_json: bool,
    out,
    err,
) -> int:
    """Print built ranks beside the planner (or the one-line refusal); the exit status of ``--build``."""
    from respo_verl.patches.meta_build import header_line

    failed = [r for r in results if not r.ok]
    if failed:
        first = failed[0]
        if first.stage == MODEL_CONFIG_STAGE:
            print(f"respo-verl plan --build: the model config cannot be built by mbridge: {first.error}", file=err)
            return 2
        where = f"rank {first.request.rank}" + ("" if len(failed) == 1 else f" (and {len(failed) - 1} more)")
        print(
            f"respo-verl plan --build: megatron refuses {preset} ({_layout_keys(lay, overrides)}) at {first.stage}, "
            f"{where}: {first.error}",
            file=err,
        )
        return 1
    disagree = 0
    if not as_json:
        print(header_line(), file=out)
    for res in results:
        checks = compare(model, lay, res.figures)
        disagree += sum(not c.ok for c in checks)
        if as_json:
            print(json.dumps(rank_record(preset, res, checks)), file=out)
            continue
        print(_fmt_rank(preset, res), file=out)
        print(f"  {'item':<32}{'megatron':>18}{'planner':>18}{'diff':>14}{'tolerance':>12}", file=out)
        for c in checks:
            mark = "" if c.ok else "  DISAGREES"
            print(f"  {c.item:<32}{c.build:>18,}{c.planner:>18,}{c.diff:>14,}{c.tolerance:>12,}{mark}", file=out)
        opt = res.figures["optimizer"]
        where = ", ".join(f"{k} on {v['where']}" for k, v in opt.items() if v["where"])
        lazy = [k for k, v in opt.items() if v["where"] and not v["states_created"]]
        note = f"; Adam states of {', '.join(lazy)} are created at the first step (not counted)" if lazy else ""
        print(f"  optimizer shards: {where}{note}", file=out)
    if disagree:
        if not as_json:
            print(f"DISAGREES: {disagree} figure(s) differ from the planner beyond the tolerance", file=out)
        return 1
    if not as_json:
        print(f"OK: megatron built {len(results)} rank(s) of {preset}; every figure agrees with the planner", file=out)
    return 0
