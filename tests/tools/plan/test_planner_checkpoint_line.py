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
