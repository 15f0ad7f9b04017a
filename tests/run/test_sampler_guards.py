"""The guards on what the sampler produced (respo_verl/run/guards.py): sampler agreement and routing replay.

Pure: a step's metrics in, a stop, a warning or nothing out. The metric values are those of real CPU runs
(docs/cpu.md): a healthy R3 run with vLLM, a run whose vLLM returned all-zero routes, and one whose expert weights
never reached vLLM.
"""

from __future__ import annotations

import re

import pytest
from conftest import compose
from omegaconf import OmegaConf

from respo_verl.run.guards import WARNINGS_KEY, GuardConfig, StepGuards, check_guards
from respo_verl.run.stops import EXIT_GUARD, RunStopped

CPU = {"max_probs_diff_max": 1e-4, "max_probs_diff_mean": None, "max_route_reject_share": 0.01}


def healthy_r3(**changes) -> dict:
    """Step metrics of a healthy R3 step (vLLM on CPU, 2 MoE layers), with ``changes``."""
    metrics = {
        "training/rollout_probs_diff_max": 1.4e-6,
        "training/rollout_probs_diff_mean": 1.1e-7,
        "actor/routing/replayed_tokens": 111.75,
        "actor/routing/compute_log_prob/replayed_tokens": 447.0,
        "actor/routing/compute_log_prob/flip_frac/layer_0": 0.0,
        "actor/routing/compute_log_prob/flip_frac/layer_1": 0.0,
        "actor/routing/flip_frac/layer_0": 0.018,  # the update pass: drift under reuse, not a fault
    }
    metrics.update(changes)
    return {k: v for k, v in metrics.items() if v is not None}


def guards(replay: str = "r3", **config) -> StepGuards:
    return StepGuards(GuardConfig(**{**CPU, **config}), replay=replay)


def test_a_healthy_r3_step_passes_and_adds_no_key():
    metrics = healthy_r3()
    guards().check(metrics, 1)
    assert metrics == healthy_r3()


def test_zero_routes_stop_with_the_routing_guard_before_the_agreement_guard():
    """All-zero routes from vLLM: nothing replayed, and the probabilities disagree too (0.88 measured): the routing
    guard's line names the cause."""
    metrics = healthy_r3(
        **{
            "actor/routing/compute_log_prob/replayed_tokens": 0.0,
            "actor/routing/replayed_tokens": 0.0,
            "actor/routing/compute_log_prob/flip_frac/layer_0": None,
            "actor/routing/compute_log_prob/flip_frac/layer_1": None,
            "training/rollout_probs_diff_max": 0.88,
        }
    )
    with pytest.raises(RunStopped) as stop:
        guards().check(metrics, 1)
    assert stop.value.exit_status == EXIT_GUARD
    assert str(stop.value).startswith(
        "step 1: actor/routing/compute_log_prob/replayed_tokens=0 with router_replay.mode=R3: the compute_log_prob "
        "pass replayed no route"
    )


def test_a_pass_the_engine_logged_nothing_for_replayed_no_route():
    """vLLM's all-zero routes as the route-drift engine logs them (measured): the update pass counts 0 replayed tokens,
    and compute_log_prob, which replayed none, has no key at all."""
    metrics = healthy_r3(
        **{
            "actor/routing/compute_log_prob/replayed_tokens": None,
            "actor/routing/compute_log_prob/flip_frac/layer_0": None,
            "actor/routing/compute_log_prob/flip_frac/layer_1": None,
            "actor/routing/replayed_tokens": 0.0,
            "training/rollout_probs_diff_max": 0.89,
        }
    )
    with pytest.raises(RunStopped, match=r"^step 1: actor/routing/compute_log_prob/replayed_tokens=0 with router_"):
        guards().check(metrics, 1)


def test_missing_expert_weights_stop_with_the_agreement_guard_before_the_rejected_share():
    """Expert weights that never reached vLLM (step 2 measured: max 0.29, 2.5 % of routes rejected)."""
    metrics = healthy_r3(
        **{
            "training/rollout_probs_diff_max": 0.29,
            "actor/routing/compute_log_prob/flip_frac/layer_1": 0.025,
        }
    )
    with pytest.raises(RunStopped) as stop:
        guards().check(metrics, 2)
    assert str(stop.value).startswith(
        "step 2: training/rollout_probs_diff_max=0.29 > run_guard.max_probs_diff_max=0.0001: the sampler's token "
        "probabilities disagree with the trainer's"
    )


def test_rejected_routes_stop_naming_the_worst_layer_and_its_share():
    metrics = healthy_r3(**{"actor/routing/compute_log_prob/flip_frac/layer_1": 0.04})
    with pytest.raises(RunStopped, match=r"^step 3: layer 1: 0\.040 of the replayed tokens' routes .* > "):
        guards().check(metrics, 3)


def test_r2_checks_the_update_pass_only_and_never_the_rejected_share():
    # R2 records at compute_log_prob (nothing replayed there) and replays in the update
    metrics = healthy_r3(
        **{
            "actor/routing/compute_log_prob/replayed_tokens": None,
            "actor/routing/compute_log_prob/flip_frac/layer_0": 0.9,
        }
    )
    guards("r2").check(dict(metrics), 1)
    with pytest.raises(RunStopped, match=r"replayed_tokens=0 with router_replay\.mode=R2: the update pass"):
        guards("r2").check({**metrics, "actor/routing/replayed_tokens": 0.0}, 1)


def test_without_replay_the_routing_guard_reads_nothing():
    guards("off").check({"training/rollout_probs_diff_max": 1e-6}, 1)


def test_missing_route_metrics_under_replay_are_named():
    metrics = {"training/rollout_probs_diff_max": 1e-6}  # no key of the route-drift engine at all
    with pytest.raises(RunStopped, match="replayed_tokens is missing: the route-drift engine did not run"):
        guards().check(metrics, 1)


def test_a_sampler_without_log_probs_is_refused_with_the_job():
    job = {"run_guard": CPU, "actor_rollout_ref": {"rollout": {"calculate_log_probs": False}}}
    with pytest.raises(
        ValueError, match=r"calculate_log_probs=false: set it to true .* or run_guard\.sampler_agreement"
    ):
        check_guards(OmegaConf.create(job))
    check_guards(OmegaConf.create({**job, "run_guard": {**CPU, "sampler_agreement": "off"}}))


def test_the_cluster_bound_is_on_the_mean():
    cluster = StepGuards(GuardConfig())  # the dataclass defaults are the cluster's
    cluster.check({"training/rollout_probs_diff_max": 0.9, "training/rollout_probs_diff_mean": 4e-3}, 1)
    with pytest.raises(RunStopped, match=r"rollout_probs_diff_mean=0\.08 > run_guard\.max_probs_diff_mean=0\.05"):
        cluster.check({"training/rollout_probs_diff_max": 0.9, "training/rollout_probs_diff_mean": 0.08}, 2)


def test_warn_prints_one_line_per_step_and_counts_in_the_log(capsys):
    g = guards(sampler_agreement="warn", routing_replay="warn")
    bad = {"training/rollout_probs_diff_max": 0.29, "actor/routing/compute_log_prob/flip_frac/layer_0": 0.5}
    for step in (1, 2):
        metrics = healthy_r3(**bad)
        g.check(metrics, step)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        line
        for step in (1, 2)
        for line in (
            f"respo-verl: WARNING: run_guard.sampler_agreement=warn: step {step}: training/rollout_probs_diff_max="
            "0.29 > run_guard.max_probs_diff_max=0.0001: the sampler's token probabilities disagree with the "
            "trainer's before its first update of the step; usually the weights did not all reach the sampler "
            "(names its loader skipped, a failed sync), or sampler and trainer compute different models (dtype, "
            "kernels, routes)",
            f"respo-verl: WARNING: run_guard.routing_replay=warn: step {step}: layer 0: 0.500 of the replayed "
            "tokens' routes are not the trainer's router's top-k at compute_log_prob "
            "(actor/routing/compute_log_prob/flip_frac/layer_0) > run_guard.max_route_reject_share=0.01: the "
            "sampler's routes belong to other weights or another model",
        )
    ]
    assert metrics[f"{WARNINGS_KEY}/sampler_agreement"] == 2.0
    assert metrics[f"{WARNINGS_KEY}/routing_replay"] == 2.0
    assert metrics[WARNINGS_KEY] == 4.0


def test_off_checks_nothing():
    g = guards(sampler_agreement="off", routing_replay="off")
    g.check({"actor/routing/replayed_tokens": 0.0}, 1)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("sampler_agreement", "loud", "must be one of stop, warn, off"),
        ("routing_replay", "STOP", "must be one of stop, warn, off"),
        ("max_probs_diff_max", 2.0, r"must be in \[0, 1\]"),
        ("max_route_reject_share", -0.1, r"must be in \[0, 1\]"),
    ],
)
def test_bad_guard_settings_are_refused_naming_the_key(key, value, message):
    with pytest.raises(ValueError, match=rf"^run_guard\.{key} {message}, got {re.escape(repr(value))}$"):
        GuardConfig(**{key: value})


def test_agreement_without_a_bound_is_refused():
    with pytest.raises(ValueError, match="needs a bound"):
        GuardConfig(max_probs_diff_max=None, max_probs_diff_mean=None)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ((), {"max_probs_diff_max": None, "max_probs_diff_mean": 0.05, "max_route_reject_share": 0.3}),
        (("+device=cpu",), CPU),
        (("+device=cpu_megatron", "model_engine=megatron", "routing=r3"), CPU),
    ],
)
def test_presets_set_the_guards_bounds(overrides, expected):
    """The algorithm presets' defaults (configs/respo_verl/run_guard.yaml) and the CPU presets' overrides compose
    into valid guards with the bounds docs/cluster.md states, both modes on stop."""
    cfg = compose(["algorithm=respo", *overrides])
    config = GuardConfig.from_config(OmegaConf.to_container(cfg.run_guard))
    assert {key: getattr(config, key) for key in expected} == expected
    assert (config.sampler_agreement, config.routing_replay) == ("stop", "stop")
