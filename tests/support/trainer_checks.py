"""What every end-to-end run of verl's trainer on CPU is checked for, on the lines of verl's file logger.

Shared by the FSDP runs of tests/cpu/test_cpu_trainer.py and tests/cpu/test_cpu_resume.py (whose uninterrupted
reference run is also the check that ReSPO trains with rollout reuse through our entry point).
"""

from __future__ import annotations

RESPO_KEYS = (
    "actor/respo/pos/frac",
    "actor/respo/pos/log_w_mean",
    "actor/respo/pos/phi_mean",
    "actor/respo/neg/frac",
    "actor/respo/neg/log_w_mean",
    "actor/respo/neg/phi_mean",
    "actor/respo/clamp_frac",
    "actor/respo/starved_frac",
    "actor/respo/starved_mass_share",
)
# The rollout and the actor compute log-probs of the same tokens with the same fp32 weights when weights are synced
# (measured ~1e-6); a server that kept stale weights differs by >= 1e-3 after one update at lr 1e-2.
SYNCED_LOG_PROB_GAP = 1e-4
# Rollout reuse: the 2nd..N-th mini-batches are off-policy, so |mean log W| of a branch is away from 0 (0.03-0.16 per
# step measured with the preset's lr 1e-4, N = 4); on-policy (N = 1) it is float noise (~1e-5).
STALE_LOG_W = 1e-2
ON_POLICY_LOG_W = 1e-4


def assert_weights_synced(lines: list[dict]) -> None:
    gaps = [line["data"]["training/rollout_probs_diff_max"] for line in lines]
    assert max(gaps) < SYNCED_LOG_PROB_GAP, f"rollout/actor log-prob gap per step: {gaps}"


def assert_trains(lines: list[dict]) -> None:
    """Every step with a non-zero advantage has a non-zero gradient, and some step has one.

    A step whose prompts all got one reward (e.g. every answer wrong) has advantages 0 everywhere, and then the
    gradient is exactly 0: that is right, not a failure. The rollout server's sampling is not reproducible from run to
    run (it depends on how the agent loop interleaves requests), so such a step can occur in any run.
    """
    learning = []
    for line in lines:
        data = line["data"]
        flat = data["critic/advantages/max"] == 0.0 and data["critic/advantages/min"] == 0.0
        if flat:
            assert data["actor/grad_norm"] == 0.0, (
                f"step {line['step']}: zero advantages, grad norm {data['actor/grad_norm']}"
            )
        else:
            assert data["actor/grad_norm"] > 0, f"step {line['step']}: non-zero advantages but no gradient"
            learning.append(line["step"])
        assert data["actor/loss"] == data["actor/loss"]  # finite, not NaN
    assert learning, "no step had a non-zero advantage: the run never trained"


def log_w(lines: list[dict]) -> list[float]:
    """|mean log W| of each branch at each step."""
    return [abs(line["data"][f"actor/respo/{b}/log_w_mean"]) for line in lines for b in ("pos", "neg")]
