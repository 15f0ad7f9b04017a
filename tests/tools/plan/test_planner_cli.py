"""`respo-verl plan`: a table and exit 0 for a preset that fits; clear one-line errors, no Hydra traceback, for
bad input; exit 1 listing every violated rule."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from respo_verl.tools.plan.cli import main
from respo_verl.tools.plan.presets import PRESETS

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


def test_r3_routes_of_a_step_that_exceed_the_object_store_exit_1_naming_the_key(capsys):
    """The paper's N = 32 under R3: 27.0 GiB of uint8 routes a step, 14 % of a 2 TB node's object store; a node of
    64 GiB (object store 19.2 GiB) cannot hold them."""
    argv = ["qwen3_30b_a3b_h100_2x8", "data.train_batch_size=1024", "routing=r3"]
    assert main(argv) == 0
    assert "routing replay / step                27.0   R3: uint8, ≤ 3.4 MiB/sample; 14% of" in capsys.readouterr().out
    assert main([*argv, "--host-memory-gib", "64"]) == 1
    out = capsys.readouterr().out
    assert "[routing-replay-host] R3's routes of one step, up to 27.0 GiB, exceed" in out
    assert "lower data.train_batch_size" in out


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
        (["qwen3_1p7b_h100_1x8", "--host-memory-gib", "0"], "--host-memory-gib must be > 0"),
        (["qwen3_1p7b_h100_1x8", "trainer.nnodes=abc"], "trainer.nnodes must be an integer, got 'abc'"),
        (["qwen3_30b_a3b_h100_2x8", f"{MG}.tensor_model_parallel_size=two"], "tensor_model_parallel_size must be an"),
        (["qwen3_1p7b_h100_1x8", "actor_rollout_ref.rollout.gpu_memory_utilization=high"], "must be a number"),
        (
            ["qwen3_1p7b_h100_1x8", "actor_rollout_ref.actor.policy_loss.respo.alpha_pos=0.5"],
            "actor_rollout_ref.actor.policy_loss.respo: ReSPOConfig.alpha_pos must be >= 1, got 0.5",
        ),
        (
            ["qwen3_1p7b_h100_1x8", "--algorithm", "vespo", "actor_rollout_ref.actor.policy_loss.vespo.k_pos=-1"],
            "VESPOConfig.k_pos must be >= 0",
        ),
    ],
)
def test_bad_input_is_one_clear_message(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.out == ""  # refused before anything is printed


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["qwen3_1p7b_h100_1x8", "--algorithm", "respoo"],
            "respo-verl plan: --algorithm respoo: no such algorithm (one of respo, vespo, grpo, gspo, respo_pos, "
            "respo_neg, phi_one, grpo_noclip)",
        ),
        (
            ["qwen3_1p7b_h100_1x8", "routing=r4"],
            "respo-verl plan: cannot compose preset 'qwen3_1p7b_h100_1x8' with overrides ['routing=r4']: cannot "
            "compose the 'respo' job: In 'respo_trainer': Could not find 'routing/r4'; Available options in "
            "'routing':; off; r2; r3",
        ),
    ],
)
def test_an_unknown_preset_option_is_one_short_line_without_hydras_search_path(capsys, argv, line):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == line + "\n" and captured.out == ""


def test_no_gpus_is_a_world_size_violation(capsys):
    assert main(["qwen3_30b_a3b_h100_2x8", "trainer.nnodes=0"]) == 1
    out = capsys.readouterr().out
    assert "[world-size]" in out and "0×8 = 0 GPUs" in out
    assert "DP 0" not in out  # no memory table for an empty grid


def test_plan_imports_neither_verl_nor_torch():
    # The rules and the memory model need neither; importing verl alone costs ~8 s of CPU.
    code = (
        "import sys\n"
        "from respo_verl.tools.plan.cli import main\n"
        "code = main(['qwen3_30b_a3b_h100_2x8', 'actor_rollout_ref.actor.policy_loss.respo.beta_pos=0.25'])\n"
        "print(code, sorted(m for m in ('verl', 'torch', 'ray', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 []"


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
        expected = 1 if PRESETS[preset].refused_by else 0
        assert out.returncode == expected, out.stdout + out.stderr
        assert "= training step" in out.stdout and preset in out.stdout


def test_plan_prints_what_the_preset_needs_installed(capsys):
    assert main(["qwen3_30b_a3b_h200_1x8"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("needs installed:")]
    for piece in ("8 CUDA GPU(s) per node", "vLLM (import vllm)", "megatron-core (import megatron.core)",
                  "Transformer Engine (import transformer_engine)", "mbridge (import mbridge)",
                  "DeepEP (import deep_ep)", "flash-attn (import flash_attn or import flash_attn_3)"):  # fmt: skip
        assert piece in line, line
    assert main(["qwen3_30b_a3b_h200_1x8", f"{MG}.override_transformer_config.moe_token_dispatcher_type=alltoall"]) == 0
    assert "deep_ep" not in capsys.readouterr().out
    assert main(["qwen3_1p7b_h100_1x8"]) == 0
    out = capsys.readouterr().out
    assert "needs installed: 8 CUDA GPU(s) per node, vLLM (import vllm), flash-attn (import flash_attn)\n" in out
