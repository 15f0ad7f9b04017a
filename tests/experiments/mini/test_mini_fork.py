"""The second task, ``fork`` (``experiments/mini/fork.py``): its grammar, verifier, endings and warm-start data on
hand examples, the registry that selects it, and its run names. Seconds."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.mini import fork, model, tasks
from experiments.mini.fork import EOS, GO, PAD, THINK, Ending, word
from experiments.mini.train import RunConfig


def _prompts(*digit_rows: tuple[int, int, int]) -> fork.Prompts:
    return fork.prompts_of(torch.tensor(digit_rows))


def _batch(*rows: list[int]) -> torch.Tensor:
    out = torch.full((len(rows), fork.FORK.MAX_RESPONSE_LEN), PAD)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def _answer(segments: int, v: int = 0) -> list[int]:
    """``segments`` segments of word v of every step, stopping after the last."""
    out = [THINK]
    for i in range(segments):
        out += [word(s, v) for s in range(i * fork.FORK.SEGMENT_STEPS, (i + 1) * fork.FORK.SEGMENT_STEPS)]
        out.append(EOS if i == segments - 1 else GO)
    return out


def test_the_digit_sum_sets_the_segments_and_the_length():
    digits = torch.tensor([[0, 0, 0], [1, 1, 1], [2, 1, 1], [1, 2, 2], [3, 2, 1], [3, 3, 1], [4, 4, 0], [4, 4, 4]])
    assert fork.segments_needed(digits).tolist() == [2, 2, 3, 3, 4, 4, 5, 5]  # sums 0, 3, 4, 5, 6, 7, 8, 12
    assert len(_answer(2)) == 63 and len(_answer(5)) == 156 == fork.FORK.MAX_RESPONSE_LEN
    assert fork.FORK.fork_position(1) == 31 and _answer(2)[31] == GO and _answer(2)[62] == EOS


def test_verifier_rewards_the_stop_at_the_prompts_fork_without_a_mistake_only():
    easy, middle, hard = (0, 1, 2), (1, 2, 2), (4, 4, 4)  # 2, 3 and 5 segments
    with_mistake = _answer(5)
    with_mistake[100] = word(91, 2)  # position 100 is step 97 (the fourth segment's 7th): its 1st step's word
    mistake_then_overshoot = _answer(3)
    mistake_then_overshoot[3] = word(29, 0)  # step 3's place, step 30's word: the same segment
    rows = [_answer(2), _answer(3), _answer(5), _answer(3), _answer(2), _answer(5, v=3)]
    response = _batch(*rows, with_mistake, mistake_then_overshoot)
    prompts = _prompts(easy, middle, hard, easy, middle, easy, hard, easy)
    assert fork.FORK.verify(response, prompts).tolist() == [1, 1, 1, -1, -1, -1, -1, -1]
    assert fork.FORK.ending(response, prompts).tolist() == [
        Ending.COMPLETE,
        Ending.COMPLETE,
        Ending.COMPLETE,
        Ending.OVERSHOT,  # went on at its fork 2, stopped at 3
        Ending.STOPPED_EARLY,
        Ending.OVERSHOT,  # on to the last segment
        Ending.MISTAKE,  # the long wrong mode: as long as the correct answer, one mistake in it
        Ending.MISTAKE,  # a mistake counts before the overshoot
    ]
    assert fork.FORK.stopped_at(response).tolist() == [2, 3, 5, 3, 2, 5, 5, 3]
    assert fork.FORK.response_lengths(response).tolist() == [63, 94, 156, 94, 63, 156, 156, 94]
    assert fork.FORK.steps_written(response).tolist() == [60, 90, 150, 90, 60, 150, 150, 90]
    # At step 1's place (position 1): words of every other step are mistakes, of this and other segments alike.
    tokens = torch.tensor([word(1, 0), word(29, 3), word(0, 3), word(30, 0), word(149, 1), GO])
    assert fork.FORK.is_mistake(tokens, 1).tolist() == [True, True, False, True, True, False]


def test_a_word_of_another_segment_goes_on_a_token_out_of_place_ends_the_response_there():
    far_mistake = _answer(3)
    far_mistake[40] = word(100, 2)  # position 40 is step 39 (the second segment's ninth word): a word of step 101
    word_at_a_fork = _answer(3)
    word_at_a_fork[31] = word(30, 0)
    eos_mid_segment = _answer(3)
    eos_mid_segment[10] = EOS
    go_at_the_last_fork = _answer(5)
    go_at_the_last_fork[155] = GO
    digit_as_word = _answer(3)
    digit_as_word[5] = int(fork.digit(2))
    response = _batch(far_mistake, word_at_a_fork, eos_mid_segment, go_at_the_last_fork, digit_as_word)
    prompts = _prompts((1, 2, 2), (1, 2, 2), (1, 2, 2), (4, 4, 4), (1, 2, 2))
    assert fork.FORK.response_lengths(response).tolist() == [94, 32, 11, 156, 6]
    assert fork.FORK.verify(response, prompts).tolist() == [-1, -1, -1, -1, -1]
    assert fork.FORK.ending(response, prompts).tolist() == [
        Ending.MISTAKE,  # a mistake, and the answer went on to its stop
        Ending.SLIPPED,
        Ending.OTHER,
        Ending.OTHER,
        Ending.OTHER,
    ]
    assert fork.FORK.steps_written(response).tolist() == [90, 30, 9, 150, 4]


def test_breaks_grammar_position_by_position():
    tokens = torch.tensor([THINK, GO, EOS, word(0, 3), word(29, 0), word(30, 1), int(fork.digit(1))])
    assert fork.FORK.breaks_grammar(tokens, 0).tolist() == [False, True, True, True, True, True, True]
    # every word at a word's place (step 1's right, the others mistakes), nothing else
    assert fork.FORK.breaks_grammar(tokens, 1).tolist() == [True, True, True, False, False, False, True]
    assert fork.FORK.breaks_grammar(tokens, 31).tolist() == [True, False, False, True, True, True, True]  # a fork
    assert fork.FORK.breaks_grammar(tokens, 32).tolist() == [True, True, True, False, False, False, True]
    assert fork.FORK.breaks_grammar(tokens, 155).tolist() == [True, True, False, True, True, True, True]  # <eos> only
    assert fork.FORK.breaks_grammar(tokens, 156).all()


def test_verify_refuses_narrow_responses_and_mismatched_prompts():
    with pytest.raises(ValueError, match="at least 156 tokens wide"):
        fork.FORK.verify(torch.zeros(1, 10, dtype=torch.long), _prompts((0, 0, 0)))
    with pytest.raises(ValueError, match="2 responses but 1 prompts"):
        fork.FORK.verify(_batch(_answer(2), _answer(2)), _prompts((0, 0, 0)))
    with pytest.raises(ValueError, match="1 to 5 segments"):
        fork.FORK.answer(2, 6, torch.Generator())


def test_warm_start_data_err_at_their_rates():
    """The data's three errors at the recipe's rates: going on at the prompt's fork (never possible at 5 segments),
    and at each step a mistake (the answer goes on) or a slip (the answer is cut off there, without ``<eos>``);
    every answer is grammatical up to its end, a slip being one more mistake to the grammar."""
    generator = torch.Generator().manual_seed(0)
    prompts = fork.sample_prompts(3000, generator)
    response = _batch(*fork.FORK.warm_start_answers(prompts, generator))
    needed = fork.segments_needed(prompts.digits)
    lengths = fork.FORK.response_lengths(response)
    ending = fork.FORK.ending(response, prompts)
    assert set(ending.unique().tolist()) <= {Ending.COMPLETE, Ending.MISTAKE, Ending.OVERSHOT}
    # The fork where the answer should stop, among the answers that reach it.
    rows = torch.arange(len(needed))
    reached = (needed < fork.N_SEGMENTS) & (lengths > fork.FORK.fork_position(needed))
    went_on = response[rows, fork.FORK.fork_position(needed).clamp(max=fork.FORK.MAX_RESPONSE_LEN - 1)] == GO
    assert abs(float(went_on[reached].float().mean()) - fork.OVERSHOOT_SHARE) < 0.03
    assert not bool(went_on[needed == fork.N_SEGMENTS].any())
    # Per step: mistakes among the words written, slips among the steps reached. A cut-off answer ends at the
    # padding after its slip, which the grammar breaks; the slip is its last word, and a mistake.
    cut_off = response[rows, lengths - 1] == PAD
    assert bool((ending[cut_off] == Ending.MISTAKE).all())
    inside = torch.arange(fork.FORK.MAX_RESPONSE_LEN).unsqueeze(0) < lengths.unsqueeze(1)
    slips = int(cut_off.sum())
    mistakes = int((fork.FORK.is_mistake(response, torch.arange(fork.FORK.MAX_RESPONSE_LEN)) & inside).sum()) - slips
    steps = int(fork.FORK.steps_written(response).sum())
    assert abs(mistakes / steps - fork.MISTAKE_HAZARD) < 0.0008, mistakes / steps
    assert abs(slips / steps - fork.SLIP_HAZARD) < 0.0006, slips / steps
    # Answers that go on run to the last segment; the ones with a mistake are as long as the correct ones.
    assert bool((lengths[(ending == Ending.OVERSHOT) & (fork.FORK.stopped_at(response) > 0)] == 156).all())
    correct = fork.FORK.verify(response, prompts) > 0
    assert abs(float(lengths[ending == Ending.MISTAKE].float().mean() / lengths[correct].float().mean()) - 1) < 0.15


def test_registry_selects_the_task_and_names_its_runs():
    assert tasks.NAMES == ("chain", "fork") and tasks.DEFAULT == "chain"
    assert tasks.get("fork").module is fork.FORK and tasks.get("fork").high_tail
    assert not tasks.get("chain").high_tail
    with pytest.raises(ValueError, match="unknown task 'forks'; the tasks are chain, fork"):
        tasks.get("forks")
    chain_run = RunConfig("respo", 32, 0, 192, 128, lr=4e-4)
    assert chain_run.name == "respo_n32_lr4e-04_w0_seed0"  # the chain task's names are unchanged
    assert RunConfig("respo", 32, 0, 192, 128, lr=4e-4, task="fork").name == "fork_respo_n32_lr4e-04_w0_seed0"


def test_the_tasks_have_their_own_base_models():
    """The fork task's recipe key differs from the chain task's; each task's keys are its shipped models'."""
    spec, warm = model.ModelSpec(), model.WarmStart()
    assert model.recipe_key(spec, warm) == "6c5df195f4c7753f"
    assert model.recipe_key(spec, warm, "fork") != model.recipe_key(spec, warm)
    keys = {w: model.recipe_key(spec, model.WarmStart(seed=w, steps=fork.WARM_START_STEPS), "fork") for w in (0, 1)}
    assert keys == {0: "0f0e897a6ddd7cf8", 1: "cef2c5849f8be11d"}
    net = model.build_model(spec, 0, "fork")
    assert net.config.vocab_size == fork.FORK.VOCAB_SIZE
    assert net.config.max_position_embeddings == fork.PROMPT_LEN + fork.FORK.MAX_RESPONSE_LEN
    with pytest.raises(ValueError, match="a segment needs at least 2 words"):
        fork.Fork("tiny", 1)


def test_the_second_tasks_comparison_grid(tmp_path):
    """``--task fork --grid pair``: ReSPO, VESPO and respo_pos at N = 32 with the verdict's seeds, at the rate fixed
    for the second task (the other grids keep the verdict's rate), run names carrying the task; a task that does
    not exist is argparse's one line and exit 2."""
    from experiments.mini import cli, protocol

    args = cli.resolve(cli.build_parser().parse_args(["--task", "fork", "--grid", "pair", "--seeds", "0,2"]))
    assert args.task == "fork" and args.algos == ["respo", "vespo", "respo_pos"]
    assert protocol.FORK_LR == 3e-4 and args.lr == [protocol.FORK_LR]
    assert sorted(args.runs) == sorted((a, 32, protocol.FORK_LR, s) for a in args.algos for s in (0, 2))
    assert {lr for g in protocol.GRIDS.values() if g.name != "pair" for _, _, lr, _ in g.runs()} == {4e-4}
    assert cli.resolve(cli.build_parser().parse_args([])).task == "chain"
    assert cli.main(["--task", "forks", "--out", str(tmp_path)]) == 2


def _check(starved, outside, single, tail):
    from experiments.mini.regime import RegimeCheck

    return RegimeCheck(32, 1000, starved, outside, single, negatives=1000, high_tail_share=tail)


def test_regime_margin_is_the_smallest_relative_room_of_the_four_checks():
    # thresholds: starved >= 15 %, outside < 2 %, single <= 25 %, high tail >= 5 %
    assert _check(0.18, 0.01, 0.19, 0.062).margin == pytest.approx(0.18 / 0.15 - 1)  # 0.2 < 0.5, 0.24, 0.24
    assert _check(0.30, 0.019, 0.10, 0.10).margin == pytest.approx(1 - 0.019 / 0.02)  # 0.05
    assert _check(0.30, 0.01, 0.10, 0.046).margin == pytest.approx(0.046 / 0.05 - 1)  # −0.08: check 4 fails
    assert not _check(0.30, 0.01, 0.10, 0.046).holds
    assert math.isnan(_check(0.30, 0.01, 0.10, float("nan")).margin)  # no negatives: no room to speak of


def test_common_regime_rate_takes_the_most_room_where_both_methods_hold():
    from experiments.mini import protocol

    pooled = {
        ("respo", 3.25e-4): _check(0.22, 0.016, 0.17, 0.055),  # room 0.1 (high tail), 0.2 (band)
        ("vespo", 3.25e-4): _check(0.159, 0.005, 0.16, 0.050),  # room 0.06 (starved), 0 (tail): holds, room 0
        ("respo", 3.5e-4): _check(0.25, 0.018, 0.18, 0.06),  # room 0.1 (band)
        ("vespo", 3.5e-4): _check(0.18, 0.01, 0.16, 0.056),  # room 0.12 (tail)
        ("respo", 3.75e-4): _check(0.27, 0.025, 0.19, 0.07),  # check 2 fails
        ("vespo", 3.75e-4): _check(0.20, 0.012, 0.16, 0.07),
    }
    assert protocol.common_regime_rate(pooled, ["respo", "vespo"]) == 3.5e-4
    # a rate where one method fails never counts, however much room the other has
    assert protocol.common_regime_rate({k: v for k, v in pooled.items() if k[1] == 3.75e-4}, ["respo", "vespo"]) is None
    # equal room: the lower rate
    tie = {(a, lr): _check(0.18, 0.01, 0.16, 0.06) for a in ("respo", "vespo") for lr in (3.5e-4, 3.25e-4)}
    assert protocol.common_regime_rate(tie, ["respo", "vespo"]) == 3.25e-4
    with pytest.raises(ValueError, match=r"lr 0\.00035: no pooled regime checks for vespo"):
        protocol.common_regime_rate({("respo", 3.5e-4): pooled[("respo", 3.5e-4)]}, ["respo", "vespo"])


def test_the_rate_probe_runs_the_pair_grids_own_configurations(tmp_path):
    """So a grid run into the probe's folder skips the probe's runs: same names, same configuration hashes."""
    from experiments.mini import cli, experiment, protocol
    from experiments.mini.probes import fork_rate_probe

    args = cli.resolve(cli.build_parser().parse_args(["--task", "fork", "--grid", "pair", "--out", str(tmp_path)]))
    grid = {c.name: experiment.config_hash(c) for c in cli._Session(args, []).configs(args.runs)}
    probe = fork_rate_probe.configs(["respo", "vespo"], [protocol.FORK_LR], [0, 1])
    assert [c.name for c in probe] == [f"fork_{a}_n32_lr3e-04_w{s}_seed{s}" for s in (0, 1) for a in ("respo", "vespo")]
    assert {c.name: experiment.config_hash(c) for c in probe}.items() <= grid.items()
    assert protocol.FORK_RATE_CANDIDATES == (3.25e-4, 3.5e-4, 3.75e-4)
    names = {c.name for c in fork_rate_probe.configs(["respo"], list(protocol.FORK_RATE_CANDIDATES), [0])}
    assert names == {"fork_respo_n32_lr3.25e-04_w0_seed0", "fork_respo_n32_lr3.5e-04_w0_seed0",
                     "fork_respo_n32_lr3.75e-04_w0_seed0"}  # fmt: skip
