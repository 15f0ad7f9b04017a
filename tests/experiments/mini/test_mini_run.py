"""``python -m experiments.mini``: the entry point, determinism, the reuse schedule, verl's losses and log format,
the task.

Everything runs a tiny budget (a warm start of a few steps, a handful of updates) so the module takes seconds.
"""

from __future__ import annotations

import itertools
import json
import math

import orjson
import pytest
import torch

from experiments.mini import model as model_lib
from experiments.mini import protocol, regime, task, verl_adapter
from experiments.mini.train import RunConfig, UpdateEvent, train
from respo_verl.core.diagnostics import INDEPENDENT_STARVED_MASS_KEY

TIMING_KEYS = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "mini/wall_time_s")
TINY_WARM = model_lib.WarmStart(steps=3, batch_size=16)


@pytest.fixture(scope="module")
def base_model():
    """The shipped base model of warm seed 0: it completes about a quarter of its chains, so runs see both rewards."""
    torch.use_deterministic_algorithms(True)
    model, origin = model_lib.warm_start(model_lib.ModelSpec(), model_lib.WarmStart(seed=0), cache_dir=None)
    assert origin.startswith("shipped"), origin
    return model


def _without_timing(records):
    return [{"step": r["step"], "data": {k: v for k, v in r["data"].items() if k not in TIMING_KEYS}} for r in records]


def _same(a, b) -> bool:
    """Equal records; NaN equals NaN (empty-branch statistics)."""
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            continue
        if x != y:
            return False
    return True


def test_smoke_through_console_entry_point(tmp_path, capfd):
    from experiments.mini.cli import main

    out = tmp_path / "out"
    argv = ["--algos", "respo,grpo", "--reuse", "2", "--optimizer-steps", "4", "--minibatch-prompts", "1"]
    argv += ["--group-size", "4", "--warm-start-steps", "3", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    assert main([*argv, "--workers", "1"]) == 0
    captured = capfd.readouterr()
    printed = captured.out
    assert str(out.resolve()) in printed
    # The scores come from `respo-verl report` (late = last 128 updates), with the regime checks and the machine.
    assert "| ReSPO |" in printed and "| GRPO |" in printed and "## Late training score" in printed
    assert "Regime checks" in printed and "median single-token share of log W" in printed
    assert "mini/grad_clipped" in printed
    assert "torch " in printed and "thread(s) per run" in printed
    # Nothing but the progress bars reaches stderr: verl's notice that a CPU has no accelerator, and warnings, would
    # break into them.
    assert "accelerator" not in captured.err and "Warning" not in captured.err, captured.err
    assert "warm start 0" in captured.err, "the warm start shows its progress"
    assert (out / "report" / "all" / "report.md").exists() and (out / "report" / "all" / "score_n2.png").exists()
    assert "Regime checks" in (out / "results.md").read_text()
    held = sum(run["holds"] for run in json.loads((out / "summary.json").read_text())["runs"])  # json: NaN allowed
    assert f"In the regime: {held} of 2 runs" in printed, "the summary counts the runs in the regime"
    machine = orjson.loads((out / "machine.json").read_bytes())
    assert machine["torch"] == torch.__version__ and machine["torch_threads"] == "1" and machine["cpu"]
    from respo_verl.tools.runs.manifest import read_manifest

    records = read_manifest(out / "manifest.jsonl")
    assert {r.versions["torch"] for r in records} == {torch.__version__}
    for algo in ("respo", "grpo"):
        lines = (
            (out / "respo_verl_mini" / f"{algo}_n2_lr{protocol.QUICK_LR:.0e}_w0_seed0.jsonl").read_bytes().splitlines()
        )
        assert len(lines) == 4  # one line per optimizer step
        steps = [orjson.loads(line)["step"] for line in lines]
        assert steps == [1, 2, 3, 4]
    assert list((tmp_path / "cache").glob("*.pt")), "the warm-started base model is cached"


@pytest.mark.slow
def test_two_workers_give_the_numbers_of_one(tmp_path):
    """Spawned worker processes (each imports torch and verl and composes its presets: most of the test's time)."""
    from experiments.mini.cli import main

    argv = ["--algos", "respo,vespo", "--reuse", "2", "--optimizer-steps", "2", "--minibatch-prompts", "1"]
    argv += ["--group-size", "4", "--warm-start-steps", "3", "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    assert main([*argv, "--workers", "1", "--out", str(tmp_path / "one")]) == 0
    assert main([*argv, "--workers", "2", "--out", str(tmp_path / "two")]) == 0
    for algo in ("respo", "vespo"):
        name = f"respo_verl_mini/{algo}_n2_lr{protocol.QUICK_LR:.0e}_w0_seed0.jsonl"
        one = _without_timing([orjson.loads(x) for x in (tmp_path / "one" / name).read_bytes().splitlines()])
        two = _without_timing([orjson.loads(x) for x in (tmp_path / "two" / name).read_bytes().splitlines()])
        assert all(x["step"] == y["step"] and _same(x["data"], y["data"]) for x, y in zip(one, two))


def test_same_seed_same_numbers_other_seed_differs(base_model, tmp_path):
    cfg = RunConfig("respo", reuse=2, seed=0, optimizer_steps=4, rollout_prompts=2, group_size=4)
    a = _without_timing(train(cfg, base_model, tmp_path / "a").records)
    b = _without_timing(train(cfg, base_model, tmp_path / "b").records)
    assert len(a) == len(b) == 4
    assert all(x["step"] == y["step"] and _same(x["data"], y["data"]) for x, y in zip(a, b))
    other = RunConfig("respo", reuse=2, seed=1, optimizer_steps=4, rollout_prompts=2, group_size=4)
    c = _without_timing(train(other, base_model, tmp_path / "c").records)
    assert not all(_same(x["data"], y["data"]) for x, y in zip(a, c))


def test_warm_start_is_deterministic_and_cached(tmp_path):
    first, origin = model_lib.warm_start(model_lib.ModelSpec(), TINY_WARM, cache_dir=tmp_path)
    assert origin.startswith("trained")
    again, origin = model_lib.warm_start(model_lib.ModelSpec(), TINY_WARM, cache_dir=None)
    cached, origin_cached = model_lib.warm_start(model_lib.ModelSpec(), TINY_WARM, cache_dir=tmp_path)
    assert origin_cached.startswith("cached")
    for p, q, r in zip(first.parameters(), again.parameters(), cached.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r)


def test_schedule_applies_n_sequential_updates_with_fixed_pi_old(base_model, tmp_path, monkeypatch):
    reuse, prompts, group = 4, 4, 4
    # A verifier that rewards the first answer of every group gives every mini-batch non-zero advantages, so every
    # update moves the policy (the test is about the schedule, not the task).
    monkeypatch.setattr(
        task, "verify", lambda response: torch.where(torch.arange(len(response)) % group == 0, 1.0, -1.0)
    )
    events: list[UpdateEvent] = []
    cfg = RunConfig("vespo", reuse=reuse, seed=3, optimizer_steps=2 * reuse, rollout_prompts=prompts, group_size=group)
    train(cfg, base_model, tmp_path, on_update=events.append)
    assert [(e.training_step, e.minibatch) for e in events] == [(t, j) for t in (1, 2) for j in range(reuse)]
    for t in (1, 2):
        step_events = [e for e in events if e.training_step == t]
        old = step_events[0].old_log_prob
        # π_old is computed once per rollout batch and never changes while its N mini-batches are applied.
        assert all(e.old_log_prob is old for e in step_events)
        snapshot = old.clone()
        assert torch.equal(old, snapshot)
        # The mini-batches are disjoint, in order, whole prompt groups, and cover the rollout batch.
        rows = [list(range(prompts * group))[e.rows] for e in step_events]
        assert [i for r in rows for i in r] == list(range(prompts * group))
        assert all(len(r) == prompts * group // reuse for r in rows)
        # Each update changes the parameters, and the next update starts from them (sequential, not averaged).
        for prev, nxt in itertools.pairwise(step_events):
            assert prev.params_after != prev.params_before
            assert nxt.params_before == pytest.approx(prev.params_after, abs=0.0)
        # The first mini-batch is on-policy (π_θ = π_old); later ones are stale.
        first = step_events[0]
        assert torch.allclose(first.log_prob, old[first.rows], atol=1e-5)
        last = step_events[-1]
        assert not torch.allclose(last.log_prob, old[last.rows], atol=1e-5)


def test_update_event_carries_the_updated_policy_and_a_forward_with_it_leaves_the_run_alone(base_model, tmp_path):
    """Diagnostics (experiments/mini/probes/drift_probe.py) run a forward of the policy after an update on its
    mini-batch: the event's policy is the updated one, its rollout is the mini-batch's rows, and the run's numbers do
    not move."""
    from experiments.mini.rollout import response_log_prob
    from experiments.mini.train import _checksum

    cfg = RunConfig("respo", reuse=2, seed=5, optimizer_steps=4, rollout_prompts=4, group_size=4)
    plain = train(cfg, base_model, tmp_path / "plain")
    seen = []

    def forward(event: UpdateEvent) -> None:
        assert _checksum(event.policy) == event.params_after
        assert (
            event.rollout.response.shape == event.log_prob.shape == (len(range(16)[event.rows]), task.MAX_RESPONSE_LEN)
        )
        was_training = event.policy.training
        event.policy.eval()
        with torch.no_grad():
            seen.append(response_log_prob(event.policy, event.rollout))
        event.policy.train(was_training)

    probed = train(cfg, base_model, tmp_path / "probed", on_update=forward)
    assert len(seen) == 4
    a, b = _without_timing(plain.records), _without_timing(probed.records)
    assert len(a) == len(b) and all(x["step"] == y["step"] and _same(x["data"], y["data"]) for x, y in zip(a, b))


@pytest.mark.parametrize(
    ("algorithm", "loss_mode", "agg_mode"),
    [
        ("grpo", "vanilla", "token-mean"),
        ("gspo", "gspo", "seq-mean-token-mean"),
        ("vespo", "vespo", "token-mean"),
        ("respo", "respo", "token-mean"),
    ],
)
def test_losses_are_verls_registered_functions(algorithm, loss_mode, agg_mode):
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    setup = verl_adapter.load_algorithm(algorithm)
    assert setup.loss_mode == loss_mode
    assert setup.policy_loss_fn is POLICY_LOSS_REGISTRY[loss_mode]
    assert setup.loss_agg_mode == agg_mode
    if algorithm == "grpo":
        assert (setup.actor_config.clip_ratio_low, setup.actor_config.clip_ratio_high) == (0.2, 0.2)
    if algorithm == "gspo":
        assert (setup.actor_config.clip_ratio_low, setup.actor_config.clip_ratio_high) == (3e-4, 4e-4)


def test_run_calls_the_registered_loss_with_global_batch_info(base_model, tmp_path, monkeypatch):
    """Wrap the registry entry (the real function still runs) and check what the run passes to it."""
    from verl.trainer.ppo import core_algos

    real = core_algos.POLICY_LOSS_REGISTRY["respo"]
    calls = []

    def spy(**kwargs):
        calls.append({k: kwargs[k] for k in ("loss_agg_mode", "config", "response_mask", "rollout_is_weights")})
        calls[-1]["info"] = dict(kwargs["config"].global_batch_info)
        return real(**kwargs)

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "respo", spy)
    cfg = RunConfig("respo", reuse=2, seed=0, optimizer_steps=2, rollout_prompts=2, group_size=4)
    records = train(cfg, base_model, tmp_path).records
    assert len(calls) == 2
    for call in calls:
        mask = call["response_mask"]
        assert call["info"]["dp_size"] == 1
        assert call["info"]["batch_num_tokens"] == int(mask.sum())
        assert call["info"]["global_batch_size"] == mask.shape[0] == 4
        assert call["loss_agg_mode"] == "token-mean" and call["rollout_is_weights"] is None
    # The diagnostics derived from the gradient reproduce the kernel's own starvation diagnostics for ReSPO.
    for record in records:
        data = record["data"]
        for key in ("starved_frac", "pos/frac", "pos/log_w_mean", "neg/log_w_mean"):
            assert data[f"mini/diag/{key}"] == pytest.approx(data[f"actor/respo/{key}"], abs=1e-5)
        for key in ("pos/phi_mean", "neg/phi_mean", "pos/ess"):
            assert data[f"mini/diag/{key}"] == pytest.approx(data[f"actor/respo/{key}"], rel=1e-4, abs=1e-5)
        own = data["actor/respo/starved_mass_share"]
        assert data[INDEPENDENT_STARVED_MASS_KEY] == pytest.approx(own, rel=1e-4, abs=1e-5)


def test_log_lines_are_verls_file_logger_format(base_model, tmp_path, monkeypatch):
    from verl.utils.tracking import FileLogger

    cfg = RunConfig("gspo", reuse=2, seed=0, optimizer_steps=2, rollout_prompts=2, group_size=4)
    result = train(cfg, base_model, tmp_path / "ours")
    ours = result.log_path.read_bytes().splitlines()
    theirs_path = tmp_path / "verl.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(theirs_path))
    logger = FileLogger(project_name="p", experiment_name="e")
    for line in ours:
        record = orjson.loads(line)
        logger.log(data=record["data"], step=record["step"])
    logger.finish()
    assert theirs_path.read_bytes().splitlines() == ours
    first = orjson.loads(ours[0])
    assert set(first) == {"step", "data"}
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/lr", "training/global_step"):
        assert key in first["data"]
    assert first["data"]["training/global_step"] == 1 and first["step"] == 1
    assert orjson.loads(ours[1])["data"]["training/global_step"] == 1  # N = 2 optimizer steps per training step
    assert orjson.loads(ours[0]).keys() == orjson.loads(ours[1]).keys()
    assert first["data"].keys() == orjson.loads(ours[-1])["data"].keys()


def test_advantages_are_verls_grpo():
    from respo_verl.core import group_relative_advantage

    gen = torch.Generator().manual_seed(0)
    mask = torch.arange(6).unsqueeze(0) < torch.randint(1, 7, (8,), generator=gen).unsqueeze(1)  # (8, 6)
    rewards = torch.zeros(8, 6)
    rewards[torch.arange(8), mask.sum(1) - 1] = torch.tensor([1.0, -1, -1, -1, 1, 1, -1, 1])
    uids = ["a"] * 4 + ["b"] * 4
    expected = group_relative_advantage(rewards, mask, uids).adv_tok
    for algorithm in ("grpo", "respo"):
        got = verl_adapter.compute_advantages(verl_adapter.load_algorithm(algorithm), rewards, mask, uids)
        assert torch.equal(got, expected)


def _responses(rows: list[list[int]]) -> torch.Tensor:
    response = torch.full((len(rows), task.MAX_RESPONSE_LEN), task.PAD)
    for i, row in enumerate(rows):
        response[i, : len(row)] = torch.tensor(row)
    return response


def test_verifier_lengths_and_endings():
    """Only the complete chain is right; a response ends at <eos> or at its first token out of place."""
    gen = torch.Generator().manual_seed(0)
    worked = task.worked_answer(gen)
    assert len(worked) == task.WORKED_LEN == 143
    assert task.detokenize(worked[:3]).startswith(": 1.") and task.detokenize(worked[-2:]) == "# <eos>"
    gave_up = task.broken_answer(10, True, gen)  # ":", 10 words, "?"
    slipped = task.broken_answer(50, False, gen)  # ":", 50 words, a word of another step
    skipped = [*worked[:5], worked[6], *worked[7:]]  # step 5 left out: step 6's word comes one step early
    early_end = [*worked[:20], task.ANS, task.EOS]  # the answer marker after 19 steps
    no_end = [*worked[:-1], task.ANS]  # anything but <eos> after "#"
    rows = [worked, gave_up, slipped, skipped, early_end, no_end, [task.EOS]]
    response = _responses(rows)
    assert task.verify(response).tolist() == [1.0] + [-1.0] * 6
    assert task.response_lengths(response).tolist() == [143, 12, 52, 6, 21, 143, 1]
    assert task.steps_written(response).tolist() == [140, 10, 50, 4, 19, 140, 0]
    assert task.ending(response).tolist() == [0, 1, 2, 2, 3, 3, 3]
    assert int(slipped[-1]) not in range(task.word(50, 0), task.word(51, 0))
    # Words are uniform over their step's four.
    words = torch.tensor([task.worked_answer(gen)[1:-2] for _ in range(400)]) - task.word(torch.arange(task.N_STEPS), 0)
    share = torch.bincount(words.flatten(), minlength=task.WORDS_PER_STEP) / words.numel()
    assert torch.allclose(share, torch.full((task.WORDS_PER_STEP,), 0.25), atol=0.01), share


def test_sampler_stops_at_the_first_token_out_of_place(base_model):
    """The sampler ends each response at <eos> or at its first token that breaks the grammar, pads after it, and
    its mask is the task's length."""
    from experiments.mini.rollout import sample

    prompts = task.sample_prompts(16, torch.Generator().manual_seed(0)).repeat_interleave(4)
    rollout = sample(base_model, prompts, task.MAX_RESPONSE_LEN, torch.Generator().manual_seed(1))
    lengths = task.response_lengths(rollout.response)
    assert torch.equal(rollout.response_mask.sum(dim=1), lengths)
    assert int((lengths < task.WORKED_LEN).sum()) > 0 and int((lengths == task.WORKED_LEN).sum()) > 0
    for row, n in zip(rollout.response.tolist(), lengths.tolist()):
        assert all(t == task.PAD for t in row[n:])
        assert not any(bool(task.breaks_grammar(torch.tensor(row[t]), t)) for t in range(n - 1))
        assert row[n - 1] == task.EOS or bool(task.breaks_grammar(torch.tensor(row[n - 1]), n - 1))


def test_regime_counts_by_hand():
    """Two positives and a negative; the first positive drifts over many tokens, the second through one token."""
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[2, 5:] = False
    old = torch.zeros(3, 10)
    new = torch.zeros(3, 10)
    new[0] = -0.15  # log W = −1.5, ratios 0.86 (inside the band), most negative token 10 % of log W
    new[1, 0] = -1.2  # log W = −1.2, one token outside the band carrying all of it
    new[2] = -0.5  # a negative: never counted
    adv = torch.tensor([[1.0], [0.5], [-1.0]]).expand(3, 10)
    counts, shares = regime.update_counts(new, old, adv, mask)
    assert counts == {
        "mini/regime/positives": 2.0,
        "mini/regime/starved": 2.0,
        "mini/regime/starved_tokens": 20.0,
        "mini/regime/starved_tokens_outside_band": 1.0,
    }
    assert shares == pytest.approx([0.1, 1.0])
    records = [{"data": {"mini/minibatch": j, **counts}} for j in range(4)]
    check = regime.summarise(4, records, shares * 2)
    assert check.positives == 4 and check.starved_share == 1.0 and check.tokens_outside_band == 0.05
    assert check.median_single_token_share == pytest.approx(0.55)
    assert not check.holds and "NOT in the regime" in check.line()
    # Pooling runs adds their counts and takes one median of their shares: two copies of the run have its shares
    # and twice its positives, and a run without starvation dilutes the starved share.
    totals = regime.stale_totals(4, records)
    twice = regime.pool(4, [(totals, shares * 2)] * 2)
    assert twice.positives == 8 and (twice.starved_share, twice.tokens_outside_band) == (1.0, 0.05)
    assert twice.median_single_token_share == check.median_single_token_share
    calm = {k: (4.0 if k == "positives" else 0.0) for k in regime.COUNT_KEYS}
    pooled = regime.pool(4, [(totals, shares * 2), (calm, [])])
    assert (
        pooled.positives == 8
        and pooled.starved_share == 0.5
        and pooled.median_single_token_share == check.median_single_token_share
    )
    with pytest.raises(ValueError, match="no runs"):
        regime.pool(4, [])


def test_the_grid_is_pooled_per_method_and_rate():
    """``--full`` pools each (method, rate)'s grid runs at N = 32 over their seeds; other N are left out."""
    from types import SimpleNamespace

    from experiments.mini.summary import grid_regime

    run = {k: 0.0 for k in regime.COUNT_KEYS}
    done = []
    for algo, reuse, seed, starved in (
        ("respo", 32, 0, 3.0),
        ("respo", 32, 1, 1.0),
        ("vespo", 32, 0, 0.0),
        ("respo", 8, 0, 9.0),
    ):
        totals = {**run, "positives": 10.0, "starved": starved, "starved_tokens": 100.0 * starved}
        cfg = RunConfig(
            algo, reuse=reuse, seed=seed, optimizer_steps=reuse, rollout_prompts=reuse, group_size=2, lr=4e-4
        )
        done.append((cfg, SimpleNamespace(stale_totals=totals, stale_shares=[0.1] * int(starved))))
    checks = grid_regime(done)
    assert set(checks) == {("respo", 4e-4), ("vespo", 4e-4)}
    assert checks[("respo", 4e-4)].positives == 20 and checks[("respo", 4e-4)].starved_share == 0.2
    assert checks[("respo", 4e-4)].holds and not checks[("vespo", 4e-4)].holds
    assert protocol.regime_rates(checks) == []
    from experiments.mini.summary import pooled_regime_lines

    lines = pooled_regime_lines(done)  # what a named grid's results.md shows
    assert len(lines) == 2 and lines[0].startswith("- respo, lr 0.0004: ") and lines[1].startswith("- vespo, lr 0.0004")
    assert lines[0].endswith(checks[("respo", 4e-4)].line())


def test_warm_start_reports_progress(tmp_path):
    seen = []
    model_lib.warm_start(model_lib.ModelSpec(), TINY_WARM, cache_dir=tmp_path, on_step=seen.append)
    assert seen == [1, 2, 3]
    model_lib.warm_start(model_lib.ModelSpec(), TINY_WARM, cache_dir=tmp_path, on_step=seen.append)
    assert seen == [1, 2, 3], "a cache hit trains nothing"


def test_replay_hooks_are_removed_when_a_run_fails(tmp_path):
    model, _ = model_lib.warm_start(model_lib.ModelSpec(moe=True), TINY_WARM, cache_dir=None)
    cfg = RunConfig("respo", reuse=2, seed=0, optimizer_steps=2, rollout_prompts=2, group_size=4, routing_replay=True)
    seen = []

    def fail(event: UpdateEvent) -> None:
        seen.append(event)
        raise RuntimeError("stop")

    real_init = __import__("respo_verl.routing.hf", fromlist=["RoutingReplay"]).RoutingReplay.__init__
    replays = []

    def spy_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        replays.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("respo_verl.routing.hf.RoutingReplay.__init__", spy_init)
        with pytest.raises(RuntimeError, match="stop"):
            train(cfg, model, tmp_path, on_update=fail)
    assert len(seen) == 1 and len(replays) == 1
    assert not replays[0].installed, "the replay hooks must not outlive a failed run"


def test_moe_variant_runs(tmp_path):
    spec = model_lib.ModelSpec(moe=True)
    model, _ = model_lib.warm_start(spec, TINY_WARM, cache_dir=None)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.num_experts == spec.num_experts and model.config.num_experts_per_tok == 2
    cfg = RunConfig("respo", reuse=2, seed=0, optimizer_steps=2, rollout_prompts=2, group_size=4)
    records = train(cfg, model, tmp_path).records
    assert len(records) == 2 and math.isfinite(records[-1]["data"]["actor/pg_loss"])


def test_r2_routing_replay_on_the_moe_variant(tmp_path):
    """R2: the π_old forward's experts are replayed in every update of the rollout batch. The first mini-batch is
    updated with the parameters that recorded its routes, so replayed and native routes agree exactly there; later
    mini-batches may drift."""
    model, _ = model_lib.warm_start(model_lib.ModelSpec(moe=True), TINY_WARM, cache_dir=None)
    cfg = RunConfig("respo", reuse=4, seed=0, optimizer_steps=8, rollout_prompts=4, group_size=4, routing_replay=True)
    records = train(cfg, model, tmp_path).records
    assert cfg.name == "respo_n4_lr1e-04_w0_seed0_r2" and len(records) == 8
    layers = model.config.num_hidden_layers
    for record in records:
        data = record["data"]
        assert {f"actor/routing/flip_frac/layer_{i}" for i in range(layers)} <= set(data)
        assert data["actor/routing/replayed_tokens"] > 0
        if data["mini/minibatch"] == 0:
            assert data["actor/routing/flip_frac"] == 0.0 and data["actor/routing/overlap"] == 1.0
        assert 0.0 <= data["actor/routing/any_layer_flip_frac"] <= 1.0
    assert not hasattr(model, "_respo_routing_replay"), "the replay hooks are removed after the run"


def test_routing_replay_through_the_console_entry_point(tmp_path, capsys):
    from experiments.mini.cli import main

    argv = ["--moe", "--routing-replay", "--algos", "vespo", "--reuse", "2", "--optimizer-steps", "2"]
    argv += ["--minibatch-prompts", "1", "--group-size", "4", "--warm-start-steps", "2", "--no-progress"]
    assert main([*argv, "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out")]) == 0
    assert f"vespo_n2_lr{protocol.QUICK_LR:.0e}_w0_seed0_r2" in (tmp_path / "out" / "results.md").read_text()
    lines = (
        (tmp_path / "out" / "respo_verl_mini" / f"vespo_n2_lr{protocol.QUICK_LR:.0e}_w0_seed0_r2.jsonl")
        .read_bytes()
        .splitlines()
    )
    assert "actor/routing/flip_frac" in orjson.loads(lines[0])["data"]


def test_warm_start_data_break_off_at_the_prompts_hazard():
    """The data are complete chains and chains that break off: half give up, half slip; at average difficulty
    ``base_success`` of them are complete, and harder prompts (larger digit sums) break off more."""
    warm = model_lib.WarmStart(batch_size=4000)
    batch = model_lib._sft_batch(warm, torch.Generator().manual_seed(0))
    ending = task.ending(batch.response)
    assert set(ending.tolist()) == {0, 1, 2}
    broken = ending > 0
    assert float((ending == 1)[broken].float().mean()) == pytest.approx(warm.give_up_share, abs=0.03)
    sums = batch.prompts.digits.sum(dim=1)
    assert float((ending == 0)[sums == 6].float().mean()) == pytest.approx(warm.base_success, abs=0.05)
    assert float((ending == 0)[sums <= 3].float().mean()) > 0.5 > 0.1 > float((ending == 0)[sums >= 9].float().mean())
    assert torch.equal(batch.response_mask.sum(dim=1), task.response_lengths(batch.response))
    for bad, field in (({"base_success": 1.0}, "base_success"), ({"give_up_share": -0.1}, "give_up_share")):
        with pytest.raises(ValueError, match=field):
            model_lib.WarmStart(**bad)
    with pytest.raises(ValueError, match="at least 143 tokens wide"):
        task.verify(batch.response[:, :10])
    flat = model_lib.hazard(torch.tensor([[0, 0, 0], [4, 4, 4]]), model_lib.WarmStart(difficulty=0.0))
    assert flat[0] == flat[1] == pytest.approx(1 - 0.3 ** (1 / task.N_STEPS))


def test_old_log_prob_in_pieces_is_the_whole_batchs(base_model):
    """π_old is recomputed in pieces of rows (faster on CPU); every number is the one-piece forward's."""
    from experiments.mini.rollout import response_log_prob, response_log_prob_no_grad, sample

    prompts = task.sample_prompts(24, torch.Generator().manual_seed(0)).repeat_interleave(4)
    rollout = sample(base_model, prompts, task.MAX_RESPONSE_LEN, torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = response_log_prob(base_model, rollout)
    pieces = response_log_prob_no_grad(base_model, rollout, rows=7)
    assert torch.equal(pieces[rollout.response_mask], whole[rollout.response_mask])
    assert not pieces.requires_grad


def test_warm_start_loss_in_length_buckets_is_the_padded_batchs():
    """The warm start sorts a batch's rows by length into buckets, each cut to its longest row: the loss and its
    gradient are those of the whole right-padded batch (causal attention: padding never reaches a response), up to
    float rounding."""
    from experiments.mini.rollout import response_log_prob

    batch = model_lib._sft_batch(model_lib.WarmStart(batch_size=24), torch.Generator().manual_seed(0))
    assert len(batch.response_mask.sum(dim=1).unique()) > 4, "the batch should hold several lengths"
    model = model_lib.build_model(model_lib.ModelSpec(), 0).train()
    grads = []
    for loss_of in (
        lambda: torch.where(batch.response_mask, response_log_prob(model, batch), 0.0).sum(),
        lambda: model_lib.log_likelihood(model, batch),
    ):
        model.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        grads.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (padded, g_padded), (bucketed, g_bucketed) = grads
    torch.testing.assert_close(bucketed, padded, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(g_bucketed, g_padded, rtol=1e-4, atol=1e-5)
