"""The regime checks at a fixed seed, from the base model the package ships.

ReSPO's run of quick mode: N = 32, the quick learning rate, 4 prompts × 8 answers per mini-batch, REGIME_UPDATES
updates (seed 0, warm seed 0, one torch thread), through ``experiments.mini.train.train``: verl's registered loss and
advantage, the real sampler and verifier, the regime checks of ``experiments.mini.regime`` on the stale half of its
rollout batches. On the project's machine it printed: starved positives 26.4 % of 1823, their tokens outside
[0.8, 1.25] 1.51 %, median single-token share 16.6 % (docs/mini.md). Runs are exact per machine, so on another CPU
the numbers move a little; the printed line shows the margins.
"""

from __future__ import annotations

import pytest
import torch

from experiments.mini import model as model_lib
from experiments.mini import protocol, regime
from experiments.mini.train import RunConfig, train

REGIME_UPDATES = protocol.QUICK_OPTIMIZER_STEPS


def test_the_default_recipe_ships_its_base_models():
    """Both warm starts of the protocol are in the package, so no run (and no CI job) trains one."""
    spec = model_lib.ModelSpec()
    for w in range(protocol.N_WARM_STARTS):
        path = model_lib.shipped_path(spec, model_lib.WarmStart(seed=w))
        assert path.is_file(), (
            f"warm seed {w}: {path} is missing; train it with `python -m experiments.mini --train-base`"
        )
        _, origin = model_lib.warm_start(spec, model_lib.WarmStart(seed=w), cache_dir=None)
        assert origin.startswith("shipped"), origin


def test_shipped_base_model_is_used_only_for_its_own_recipe(tmp_path):
    """Another recipe (here fewer warm-start steps) trains its own base model, and ``shipped=False`` trains too."""
    spec = model_lib.ModelSpec()
    tiny = model_lib.WarmStart(steps=2, batch_size=8)
    assert not model_lib.shipped_path(spec, tiny).exists()
    _, origin = model_lib.warm_start(spec, tiny, cache_dir=None)
    assert origin.startswith("trained"), origin
    assert model_lib.recipe_key(spec, tiny) != model_lib.recipe_key(spec, model_lib.WarmStart())


@pytest.fixture(scope="module")
def regime_run(tmp_path_factory):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    base, origin = model_lib.warm_start(model_lib.ModelSpec(), model_lib.WarmStart(seed=0), cache_dir=None)
    assert origin.startswith("shipped"), origin
    cfg = RunConfig(
        "respo",
        reuse=regime.REGIME_REUSE,
        seed=0,
        optimizer_steps=REGIME_UPDATES,
        rollout_prompts=protocol.MINIBATCH_PROMPTS * regime.REGIME_REUSE,
        group_size=protocol.GROUP_SIZE,
        lr=protocol.QUICK_LR,
    )
    check = train(cfg, base, tmp_path_factory.mktemp("regime")).regime
    print(check.line())
    return check


@pytest.mark.slow
def test_the_run_is_in_the_paper_regime(regime_run):
    """All three checks: at least 15 % of the stale positives starved (log W < −1), fewer than 2 % of their tokens
    outside [0.8, 1.25], and their most negative token carrying at most 25 % of log W (median)."""
    check = regime_run
    assert check.positives >= 1000, check.line()
    assert check.holds, check.line()


@pytest.mark.slow
def test_a_learning_rate_below_the_regime_does_not_starve(tmp_path):
    """The checks can fail: at half the quick rate the same run starves too few positives (check 1). One rollout
    batch (N = 32 updates), the shortest run the checks measure."""
    base, _ = model_lib.warm_start(model_lib.ModelSpec(), model_lib.WarmStart(seed=0), cache_dir=None)
    cfg = RunConfig(
        "respo",
        reuse=regime.REGIME_REUSE,
        seed=0,
        optimizer_steps=regime.REGIME_REUSE,
        rollout_prompts=protocol.MINIBATCH_PROMPTS * regime.REGIME_REUSE,
        group_size=protocol.GROUP_SIZE,
        lr=protocol.QUICK_LR / 2,
    )
    check = train(cfg, base, tmp_path).regime
    print(check.line())
    assert not check.checks[next(iter(check.checks))], check.line()


def test_the_diffusion_yardstick_of_the_high_tail_matches_the_normal_arithmetic():
    # σ = 0.7, 0.8, 1.0 and √2: shares below −1 of 14.0, 19.8, 30.9 and 50.0 % give 3.8, 4.9, 6.7 and 7.9 % above +1
    for below, above in ((0.1399, 0.0376), (0.1981, 0.0495), (0.3085, 0.0668), (0.5, 0.0786)):
        assert regime.diffusion_high_tail(below) == pytest.approx(above, abs=5e-4)
    with pytest.raises(ValueError, match=r"a diffusing log W gives shares below -1 in \(0, 1\), got 0\.0"):
        regime.diffusion_high_tail(0.0)
