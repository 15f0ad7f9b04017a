"""`respo-verl plan PRESET --build`: megatron-core builds every shipped Megatron preset on the meta device under a
fake world of the preset's size, and the planner's per-rank figures are held to what it built.

The slow tests share one module-scoped build (each distinct shard shape of every preset, PP = 2 × VPP = 2 on the
2-node preset), two ranks at a time; the bad-input tests need no build or one rank that megatron refuses.
"""

from __future__ import annotations

import io
import json
import resource
import subprocess
import sys

import pytest

from respo_verl.layout.models import QWEN3_1P7B, QWEN3_30B_A3B, shape_from_hf_config
from respo_verl.patches import UntestedVersionError, meta_build
from respo_verl.tools.plan.build import (
    BuildInputError,
    BuildRequest,
    actor_config,
    build_ranks,
    compare,
    default_ranks,
    hf_config_from_shape,
    parse_ranks,
    report_build,
)
from respo_verl.tools.plan.cli import plan
from respo_verl.tools.plan.memory import megatron_rank_figures
from respo_verl.tools.plan.presets import PRESETS

MG = "actor_rollout_ref.actor.megatron"
MEGATRON_PRESETS = [p for p, info in PRESETS.items() if info.model == "qwen3_30b_a3b"]
PP2_VPP2 = (f"{MG}.pipeline_model_parallel_size=2", f"{MG}.virtual_pipeline_model_parallel_size=2")
# The figure: what the planner missed per TP = 2 rank when it divided the replicated parameters by TP.
REPLICATED_ON_TP2 = 6_396_928
# CPU seconds: bad input is refused before anything heavy starts (composing the preset takes ~2-3 s); a refusal by
# megatron needs one rank's process, its imports and the engine's start-up (~10-15 s).
BAD_INPUT_SECONDS = 10
REFUSAL_SECONDS = 45


def _cases() -> list[tuple[str, tuple[str, ...]]]:
    return [(p, ()) for p in MEGATRON_PRESETS] + [("qwen3_30b_a3b_h100_2x8", PP2_VPP2)]


def _one_rank_per_shard_shape(preset: str, overrides: tuple[str, ...]) -> list[int]:
    lay, _, _, _ = plan(preset, overrides)
    return [s * lay.world // lay.pp for s in range(lay.pp)]  # every rank of a stage holds the same shapes


# ---- without a build ----------------------------------------------------------------------------------------------


def test_the_hand_written_hf_config_is_the_planners_model():
    # The HF config the build hands to mbridge is written from the planner's shape; read back by the planner's own
    # reader it must be the same model (and not transformers' Qwen3MoeConfig defaults: 24 layers, head_dim 64).
    cfg = hf_config_from_shape(QWEN3_30B_A3B)
    assert cfg["num_hidden_layers"] == 48 and cfg["max_position_embeddings"] == 40960 and cfg["norm_topk_prob"]
    assert cfg["head_dim"] == 128
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]

    def read_back(tmp, shape):
        (tmp / "config.json").write_text(json.dumps(hf_config_from_shape(shape)))
        return shape_from_hf_config(tmp)

    import tempfile
    from pathlib import Path

    for shape in (QWEN3_30B_A3B, QWEN3_1P7B):
        with tempfile.TemporaryDirectory() as tmp:
            back = read_back(Path(tmp), shape)
        assert back.total_params == shape.total_params and back.num_moe_layers == shape.num_moe_layers


def test_planner_keeps_norms_and_routers_whole_on_every_tp_rank():
    lay, _, _, _ = plan("qwen3_30b_a3b_h100_2x8")
    m = QWEN3_30B_A3B
    figures = megatron_rank_figures(m, lay, 0)
    everything_split = (m.total_non_expert_layer_params + m.embedding_params + m.output_params) / lay.tp
    assert figures.dense - everything_split == REPLICATED_ON_TP2
    assert figures.expert == m.total_expert_params // (lay.ep * lay.etp)


def test_default_ranks_and_ranks_option():
    lay, _, _, _ = plan("qwen3_30b_a3b_h100_2x8", PP2_VPP2)
    assert default_ranks(lay) == [0, 8, 15]  # first, middle (first of stage 1), last
    assert parse_ranks("0, 3-5,15", 16) == [0, 3, 4, 5, 15]
    with pytest.raises(BuildInputError, match=r"rank\(s\) \[16\] outside the world of 16 \(0..15\)"):
        parse_ranks("0,16", 16)
    with pytest.raises(BuildInputError, match="'x' is not a rank"):
        parse_ranks("x", 16)


def test_the_stand_ins_are_guarded_and_listed_in_the_header():
    for patch in (meta_build.MEGATRON, meta_build.MBRIDGE):
        with pytest.raises(UntestedVersionError, match=r"0\.0\.0"):
            patch.check_version("0.0.0")
        assert not patch.applied  # applied only inside a rank's own process
    line = meta_build.header_line()
    assert "\n" not in line
    for name, why, hides in meta_build.DEVIATIONS:
        assert f"{name}: {why}" in line and hides


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(argv: list[str]) -> tuple[int, str, str, float]:
    """Exit status, stdout, stderr and the CPU seconds the command (and the rank processes it waited for) used:
    CPU time, not wall time, so that other jobs on a shared machine do not decide the test."""
    start = _cpu_seconds()
    out = subprocess.run(
        [sys.executable, "-m", "respo_verl.cli", "plan", *argv], capture_output=True, text=True, timeout=600
    )
    return out.returncode, out.stdout, out.stderr, _cpu_seconds() - start


@pytest.mark.parametrize(
    "argv, message",
    [
        (["qwen3_31b_a3b", "--build"], "unknown preset 'qwen3_31b_a3b'"),
        (["qwen3_30b_a3b_h100_1x8", "--build", "--ranks", "8"], "rank(s) [8] outside the world of 8 (0..7)"),
        (["qwen3_30b_a3b_h100_1x8", "--build", "--ranks", "-1"], "'-1' is not a rank or a range a-b"),
        (["qwen3_30b_a3b_h100_1x8", "--build", "--ranks", "5-9"], "rank(s) [8, 9] outside the world of 8"),
        (["qwen3_1p7b_h100_1x8", "--build"], "--build builds Megatron presets; qwen3_1p7b_h100_1x8 runs FSDP"),
        (["qwen3_30b_a3b_h100_1x8", "--ranks", "0"], "--ranks, --json and --workers go with --build"),
    ],
)
def test_bad_input_is_one_line_exit_2_within_seconds(argv, message):
    code, out, err, seconds = _run(argv)
    assert code == 2, out + err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert out == ""
    assert seconds < BAD_INPUT_SECONDS, seconds


@pytest.mark.slow
def test_a_model_config_the_bridge_cannot_build_is_bad_input(tmp_path):
    # A valid HF config of an architecture mbridge has no bridge for.
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 2, "hidden_size": 64,
           "num_attention_heads": 4, "vocab_size": 100, "intermediate_size": 128, "n_embd": 64, "n_layer": 2,
           "n_head": 4}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, err, seconds = _run(
        ["qwen3_30b_a3b_h100_1x8", "--build", "--ranks", "0", "--model-config", str(tmp_path / "config.json")]
    )
    assert code == 2, out + err
    assert "the model config cannot be built by mbridge" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert seconds < REFUSAL_SECONDS, seconds


@pytest.mark.slow
def test_a_layout_megatron_refuses_is_its_message_in_one_line_exit_1():
    # EP 16 on 8 GPUs: the planner's rule refuses it and so does megatron's initialize_model_parallel.
    override = f"{MG}.expert_model_parallel_size=16"
    _, _, violations, _ = plan("qwen3_30b_a3b_h100_1x8", (override,))
    assert "expert-grid" in {v.rule for v in violations}
    code, out, err, seconds = _run(["qwen3_30b_a3b_h100_1x8", override, "--build", "--ranks", "0"])
    assert code == 1, out + err
    assert out == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "megatron refuses qwen3_30b_a3b_h100_1x8" in err and override in err
    assert "world_size (8) is not divisible by expert_tensor_model_pipeline_parallel size (16)" in err
    assert seconds < REFUSAL_SECONDS, seconds


# ---- built by megatron-core ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built():
    """Every case's ranks (one per distinct shard shape), built two at a time: {(preset, overrides): results}."""
    requests, keys = [], []
    for preset, overrides in _cases():
        lay, _, _, model = plan(preset, overrides)
        actor = actor_config(preset, overrides)
        for rank in _one_rank_per_shard_shape(preset, overrides):
            requests.append(BuildRequest(preset, rank, lay.world, hf_config_from_shape(model), actor))
            keys.append((preset, overrides))
    out: dict = {}
    for key, result in zip(keys, build_ranks(requests, workers=2), strict=True):
        out.setdefault(key, []).append(result)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("preset, overrides", _cases(), ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_planner_equals_megatron_on_every_preset(built, preset, overrides):
    lay, _, _, model = plan(preset, overrides)
    results = built[(preset, overrides)]
    for res in results:
        assert res.ok, f"{preset} rank {res.request.rank}: {res.stage}: {res.error}"
        layout = res.figures["layout"]
        assert (layout["tp"], layout["pp"], layout["ep"], layout["etp"]) == (lay.tp, lay.pp, lay.ep, lay.etp)
        assert (layout["dp"], layout["expert_dp"], layout["vpp"]) == (lay.dp, lay.expert_dp, lay.vpp)
        assert len(res.figures["chunks"]) == (lay.vpp or 1)
        checks = compare(model, lay, res.figures)
        items = {c.item for c in checks}
        for kind in ("dense", "expert"):
            for what in ("weights (bytes)", "grads (bytes)"):
                assert f"DDP {kind} {what}" in items
            assert f"optimizer {kind} main params" in items
        bad = [(c.item, c.build, c.planner, c.tolerance) for c in checks if not c.ok]
        assert not bad, bad
        # Exact where the planner is exact: parameters, DDP buffers; optimizer shards within megatron's padding.
        assert all(c.tolerance == 0 for c in checks if "params" in c.item and "optimizer" not in c.item)
        assert all(c.tolerance == 0 for c in checks if c.item.startswith("DDP"))


@pytest.mark.slow
def test_optimizer_shards_sit_where_the_preset_puts_them(built):
    for (preset, overrides), results in built.items():
        lay, _, _, _ = plan(preset, overrides)
        for res in results:
            for kind, opt in res.figures["optimizer"].items():
                if lay.optimizer_cpu_offload:
                    assert opt["where"].startswith("host (CPU optimizer, fraction 1"), (preset, kind, opt)
                    assert not opt["states_created"]
                else:
                    assert opt["where"] == "GPU" and opt["states"] == 2 * opt["main_params"], (preset, kind, opt)


@pytest.mark.slow
def test_report_text_and_json(built):
    preset = "qwen3_30b_a3b_h100_2x8"
    lay, _, _, model = plan(preset, PP2_VPP2)
    results = built[(preset, PP2_VPP2)]
    out, err = io.StringIO(), io.StringIO()
    assert report_build(preset, PP2_VPP2, model, lay, results, True, out, err) == 0
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["rank"] for r in records] == [0, 8]
    for record, res in zip(records, results, strict=True):
        assert record["preset"] == preset
        assert record["dense_params"] == sum(c["dense_params"] for c in res.figures["chunks"])
        assert record["expert_params"] == sum(c["expert_params"] for c in res.figures["chunks"])
        assert isinstance(record["dense_params"], int) and all(c["ok"] for c in record["checks"])
    text = io.StringIO()
    assert report_build(preset, PP2_VPP2, model, lay, results, False, text, err) == 0
    lines = text.getvalue().splitlines()
    assert lines[0] == meta_build.header_line()
    assert "TP 2 (rank 0) PP 2 (stage 1) VPP 2" in text.getvalue()
    assert lines[-1].startswith(f"OK: megatron built 2 rank(s) of {preset}")
    assert err.getvalue() == ""


@pytest.mark.slow
def test_a_figure_off_by_one_element_disagrees_with_exit_1(built):
    # The comparison can fail: the same build against a planner that counts one expert element less per rank.
    preset = "qwen3_30b_a3b_h200_1x8"
    lay, _, _, model = plan(preset)
    results = built[(preset, ())]
    figures = json.loads(json.dumps(results[0].figures))
    figures["chunks"][0]["expert_params"] += 1
    results[0].figures, saved = figures, results[0].figures
    try:
        out = io.StringIO()
        assert report_build(preset, (), model, lay, results, False, out, io.StringIO()) == 1
        assert "chunk 0 expert params" in out.getvalue() and "DISAGREES" in out.getvalue()
    finally:
        results[0].figures = saved
