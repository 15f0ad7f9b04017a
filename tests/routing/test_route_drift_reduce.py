"""The cross-rank reduction of route-drift sums (respo_verl.routing.megatron.reduce_route_drift) on a world of one:
the metrics are those of the sums themselves, an optional prefix without counts is left out, and the width of the
sums is taken from the sums (the two-rank case is tests/routing/test_megatron_pipeline_routing.py)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from respo_verl.cpu.kit.megatron_moe import megatron_cpu
from respo_verl.routing.diagnostics import drift_metrics
from respo_verl.routing.megatron import reduce_route_drift


def test_one_rank_reduction_equals_the_metrics_of_its_sums():
    # Per layer: tokens, flipped tokens, overlap sum, mass-delta sum (RouteDriftStats.sums()).
    per_layer = torch.tensor([[10.0, 2.0, 9.0, -0.5], [10.0, 0.0, 10.0, 0.0]], dtype=torch.float64)
    any_layer = torch.tensor([10.0, 2.0], dtype=torch.float64)
    with megatron_cpu():
        metrics = reduce_route_drift(
            (3, 5),
            {"routing": (per_layer, any_layer), "routing/compute_log_prob": (None, None)},
            torch.device("cpu"),
            sequence_parallel=False,
            optional_prefixes=("routing/compute_log_prob",),
        )
    expected = drift_metrics([3, 5], per_layer, any_layer, prefix="routing")
    assert set(metrics) == set(expected)  # layers 0-2 and 4 hold no MoE layer here; the optional prefix is absent
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, nan_ok=True), key
    assert metrics["routing/flip_frac/layer_3"] == pytest.approx(0.2)
    assert metrics["routing/replayed_tokens"] == 10.0


def test_nothing_counted_anywhere_gives_the_fixed_key_set_with_nan():
    with megatron_cpu():
        metrics = reduce_route_drift((0, 1), {"routing": (None, None)}, torch.device("cpu"), sequence_parallel=True)
    assert metrics["routing/replayed_tokens"] == 0.0
    assert math.isnan(metrics["routing/flip_frac/layer_1"]) and math.isnan(metrics["routing/any_layer_flip_frac"])
    assert set(metrics) == set(drift_metrics([0, 1], None, None, prefix="routing"))


def test_a_rank_without_moe_layers_returns_nothing():
    with megatron_cpu():
        assert reduce_route_drift((), {"routing": (None, None)}, torch.device("cpu"), sequence_parallel=False) == {}
