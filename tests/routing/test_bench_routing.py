"""Smoke test of ``scripts/bench/routing.py``: tiny sizes, one repeat, in-process; both models, all three
conditions in the printed table and in the returned report."""

from __future__ import annotations

import pytest
from support.scripts import load_script

pytest.importorskip("megatron.core")

bench_routing = load_script("scripts/bench/routing.py", "bench_routing")

TINY = ["--batch", "2", "--seq", "8", "--layers", "2", "--hidden", "32", "--heads", "4", "--moe-ffn", "16"]
TINY += ["--vocab", "64", "--repeats", "1", "--warmup", "0", "--perturb", "0.25"]


def test_main_prints_every_condition_for_both_models(capsys):
    report = bench_routing.main(TINY)
    out = capsys.readouterr().out
    for model in bench_routing.MODELS:
        for condition in bench_routing.CONDITIONS:
            assert f"| {model} | {condition} |" in out
            assert report["results"][model]["conditions"][condition]["median_ms"] > 0
        # Replay forces the same (perturbed) routes with and without diagnostics: same loss; the flips are seen
        # (exactly 4 of 16 tokens in the first layer; later layers see changed inputs, so only > 0 overall).
        conditions = report["results"][model]["conditions"]
        assert conditions["replay"]["loss"] == conditions["replay_diag"]["loss"]
        drift = report["results"][model]["drift"]
        assert drift["replayed_tokens"] == 16 and 0 < drift["flip_frac"] <= 1
    assert "- command: `" in out and "- torch_threads: `1`" in out and "- megatron-core: `" in out
