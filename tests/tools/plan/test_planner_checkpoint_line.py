"""The plan's checkpoint line names no model the user did not give: a preset without a model path says so."""

from __future__ import annotations

from pathlib import PurePosixPath

from omegaconf import OmegaConf

from respo_verl.tools.plan.checkpoints import MISSING_MODEL_PLACEHOLDER, MODEL_PATH, verl_default_model_path
from respo_verl.tools.plan.cli import main
from respo_verl.tools.plan.presets import compose_preset


def _checkpoint_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 0
    out = capsys.readouterr().out.replace("\n", " ")  # rich wraps the line at the table width
    start = out.index("checkpoints:")
    return out[start : out.index("needs installed:", start)]


def test_a_preset_without_a_model_path_says_it_is_missing(capsys):
    # Without a model path the preset inherits verl's default model, which must not be named.
    cfg = compose_preset("qwen3_30b_a3b_h100_2x8")
    default = verl_default_model_path()
    assert OmegaConf.select(cfg, MODEL_PATH) == default
    line = _checkpoint_line(capsys, ["qwen3_30b_a3b_h100_2x8"])
    assert PurePosixPath(default).name not in line
    assert f"/{MISSING_MODEL_PLACEHOLDER}-respo-n" in line and f"{MODEL_PATH} is missing" in line


def test_a_given_model_path_names_the_folder(capsys):
    line = _checkpoint_line(capsys, ["qwen3_30b_a3b_h100_2x8", f"{MODEL_PATH}=/models/Qwen3-30B-A3B-Base"])
    assert "/Qwen3-30B-A3B-Base-respo-n" in line and "missing" not in line and MISSING_MODEL_PLACEHOLDER not in line


# Qwen3-30B-A3B (its published config.json) at TP 2, EP 8, ETP 1, PP 1, the parameters of one rank, by hand:
# attention per layer: q 2048·32·128 + k, v 2·2048·4·128 + o 32·128·2048 = 18,874,368, split over TP 2: 9,437,184;
# replicated per layer: norms 2·128 + 2·2048 = 4,352, router 2048·128 = 262,144; 48 layers: 465,776,640; embedding
# and output layer 151,936·2048 / 2 = 155,582,464 each, final norm 2,048.
DENSE_PER_RANK = 776_943_616
# 48 layers of 128 experts of 3·2048·768 = 4,718,592 parameters, over EP 8.
EXPERTS_PER_RANK = 3_623_878_656
# 12 B × (776,943,616 + 3,623,878,656 = 4,400,822,272): the fp32 main parameters, exp_avg and exp_avg_sq.
STATE_BYTES = 52_809_867_264
# The largest buffer is the experts' (expert data parallel 16 / (8·1) = 2 on 2×8, 1 on 1×8): its own piece of the
# three states (12 B × E / DP) and the received pieces of one state with the concatenations (12 B × E).
PEAK_BYTES = {"2x8": STATE_BYTES + 12 * EXPERTS_PER_RANK * 3 // 2, "1x8": STATE_BYTES + 12 * EXPERTS_PER_RANK * 2}


def test_the_fully_reshardable_save_costs_12_bytes_per_parameter_of_the_shard_and_a_buffer_while_it_gathers():
    from respo_verl.layout.models import QWEN3_30B_A3B
    from respo_verl.layout.parallel import layout_from_config
    from respo_verl.tools.plan.checkpoints import reshardable_save

    assert STATE_BYTES == 12 * (DENSE_PER_RANK + EXPERTS_PER_RANK)
    for nodes in ("2x8", "1x8"):
        save = reshardable_save(QWEN3_30B_A3B, layout_from_config(compose_preset(f"qwen3_30b_a3b_h100_{nodes}")))
        assert (save.params, save.state_bytes, save.peak_bytes) == (
            DENSE_PER_RANK + EXPERTS_PER_RANK,
            STATE_BYTES,
            PEAK_BYTES[nodes],
        )
    assert PEAK_BYTES == {"2x8": 118_039_683_072, "1x8": 139_782_955_008}


def test_the_checkpoint_line_names_the_optimizer_format_and_the_switchs_host_memory(capsys):
    line = _checkpoint_line(capsys, ["qwen3_30b_a3b_h100_2x8"])
    assert (
        "; optimizer saved dp_reshardable (a relaunch may change DP only; +respo_verl=fully_reshardable also VPP, CP, "
        "ETP and EP above 1, for up to 118 GB of host RAM per save process (53 GB of gathered fp32 state: 12 B × "
        "4.40 B parameters of its shard))"
    ) in " ".join(line.split())
    line = _checkpoint_line(capsys, ["qwen3_30b_a3b_h100_1x8", "+respo_verl=fully_reshardable"])
    assert (
        "; optimizer saved fully_reshardable (a relaunch may change DP, VPP, CP, ETP, EP above 1): up to 140 GB of "
        "host RAM per save process (53 GB of gathered fp32 state: 12 B × 4.40 B parameters of its shard)"
    ) in " ".join(line.split())
    # FSDP saves each rank's own shards: no optimizer format to name
    assert "optimizer saved" not in _checkpoint_line(capsys, ["qwen3_1p7b_h100_1x8"])
