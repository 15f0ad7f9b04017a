"""Update-index labels of the route-drift metrics (``respo_verl/routing/diagnostics.py``): exact j, then buckets."""

from __future__ import annotations

import pytest

from respo_verl.routing.diagnostics import (
    EXACT_UPDATES,
    drift_metrics,
    parse_update_label,
    per_update_metrics,
    update_label,
)


@pytest.mark.parametrize(
    ("j", "label", "span"),
    [(0, "j0", (0, 0)), (31, "j31", (31, 31)), (63, "j63", (63, 63)), (64, "j64-127", (64, 127)),
     (127, "j64-127", (64, 127)), (128, "j128-255", (128, 255)), (1000, "j512-1023", (512, 1023))],
)  # fmt: skip
def test_labels_are_exact_below_the_limit_then_power_of_two_buckets(j, label, span):
    assert EXACT_UPDATES == 64
    assert update_label(j) == label
    assert parse_update_label(label) == span
    assert span[0] <= j <= span[1]


def test_bad_labels_and_indices():
    assert parse_update_label("layer_3") is None and parse_update_label("j") is None
    with pytest.raises(ValueError, match="update index -1: must be >= 0"):
        update_label(-1)


def test_per_update_metrics_keep_the_whole_model_keys_only():
    import torch

    per_layer = torch.tensor([[4.0, 1.0, 3.5, -0.1], [4.0, 0.0, 4.0, 0.0]], dtype=torch.float64)
    metrics = drift_metrics([0, 1], per_layer, torch.tensor([4.0, 1.0], dtype=torch.float64), prefix="routing")
    metrics["routing/compute_log_prob/flip_frac"] = 0.5  # another prefix: not an update's drift
    metrics["routing/any_layer_flip_frac/pp_stage_1"] = 0.25
    out = per_update_metrics(metrics, 2, prefix="routing")
    assert out == {
        "routing/by_update/j2/flip_frac": 1 / 8,
        "routing/by_update/j2/overlap": 7.5 / 8,
        "routing/by_update/j2/prob_mass_delta": pytest.approx(-0.1 / 8),
        "routing/by_update/j2/any_layer_flip_frac": 1 / 4,
        "routing/by_update/j2/any_layer_flip_frac/pp_stage_1": 0.25,
        "routing/by_update/j2/replayed_tokens": 4.0,
    }
