"""`respo-verl plan`: a table and exit 0 for a preset that fits; clear one-line errors, no Hydra traceback, for
bad input; exit 1 listing every violated rule."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from respo_verl.planner.cli import main
from respo_verl.planner.presets import PRESETS

MG = "actor_rollout_ref.actor.megatron"


def test_fitting_preset_prints_a_table_and_exits_0(capsys):
    assert main(["qwen3_1p7b_h100_1x8"]) == 0
    out = capsys.readouterr().out
    for row in ("weights", "optimizer", "activations", "logits", "= training step", "rollout: KV cache", "peak"):
        assert row in out
    assert "OK: every rule holds" in out


def test_markdown_table(capsys):
    assert main(["qwen3_30b_a3b_h200_1x8", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| phase / item" in out and "routing replay / step" in out


def test_rule_breaking_override_exits_1_listing_every_rule(capsys):
    code = main(["qwen3_30b_a3b_h100_1x8", f"{MG}.tensor_model_parallel_size=3", f"{MG}.expert_model_parallel_size=3"])
    out = capsys.readouterr().out
    assert code == 1
    assert "[world-grid]" in out and "[experts-ep]" in out and "[heads-tp]" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["qwen3_31b"], "unknown preset 'qwen3_31b'"),
        (["qwen3_1p7b_h100_1x8", "trainer.nnodes"], "not of the form key=value"),
        (["qwen3_1p7b_h100_1x8", "trainer.no_such_key=1"], "cannot compose preset"),
        (["qwen3_1p7b_h100_1x8", "--gpu-memory-gib", "-1"], "--gpu-memory-gib must be > 0"),
    ],
)
def test_bad_input_is_one_clear_message(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_model_config_path(tmp_path, capsys):
    assert main(["qwen3_1p7b_h100_1x8", "--model-config", str(tmp_path / "missing.json")]) == 2
    assert "model config not found" in capsys.readouterr().err
    cfg = {"num_hidden_layers": 28, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8,
           "head_dim": 128, "vocab_size": 151936, "intermediate_size": 6144, "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["qwen3_1p7b_h100_1x8", "--model-config", str(tmp_path / "config.json")]) == 0


@pytest.mark.slow
def test_console_script_for_every_preset():
    for preset in PRESETS:
        out = subprocess.run(
            [sys.executable, "-m", "respo_verl.cli", "plan", preset], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "= training step" in out.stdout and preset in out.stdout
