"""The demo's regime task on CPU: the chain task's grammar, reward and stop rule, its kit, and the rollout server's
stop rule (``actor_rollout_ref.rollout.custom.stop_rule``) on the server itself."""

from __future__ import annotations

import asyncio
import random

import pandas as pd
import pytest
from omegaconf import OmegaConf

from respo_verl.cpu.kit import chain
from respo_verl.cpu.kit.build import CHAIN, build_kit
from respo_verl.cpu.kit.reward import compute_score
from respo_verl.cpu.rollout import CPURolloutServer, load_stop_rule

VOCAB = chain.vocabulary()
STOP_RULE = "respo_verl.cpu.kit.chain:ends_answer"


@pytest.fixture(scope="module")
def kit():
    return build_kit(CHAIN, progress=False)


def _ids(text: str) -> list[int]:
    return [VOCAB[token] for token in text.split()]


def test_the_grammar_allows_one_word_of_each_step_in_turn_and_the_stop_rule_ends_at_the_first_break():
    answer = [*_ids(" ".join(chain.complete_chain(random.Random(0)))), VOCAB[chain.EOS]]
    assert len(answer) == chain.MAX_RESPONSE_TOKENS == chain.STEPS + 3
    assert [chain.ends_answer(i, t) for i, t in enumerate(answer)] == [False] * (len(answer) - 1) + [True]
    assert chain.ends_answer(3, VOCAB[chain.word(2, 3)]) is False  # any word of step 3
    assert chain.ends_answer(3, VOCAB[chain.word(3, 0)]) is True  # a word of step 4: a slip
    assert chain.ends_answer(3, VOCAB[chain.GIVE_UP]) is True
    assert chain.ends_answer(0, VOCAB[chain.word(0, 0)]) is True  # the answer opens with ":"
    assert chain.ends_answer(chain.STEPS + 3, VOCAB[chain.EOS]) is True  # nothing after the end


def test_the_reward_is_plus_one_for_the_complete_chain_only():
    rng = random.Random(1)
    complete = " ".join(chain.complete_chain(rng))
    assert compute_score(chain.DATA_SOURCE, complete, chain.COMPLETE) == 1.0
    assert compute_score(chain.DATA_SOURCE, complete + " 1.a", chain.COMPLETE) == -1.0
    assert compute_score(chain.DATA_SOURCE, " ".join(complete.split()[:-1]), chain.COMPLETE) == -1.0
    for _ in range(20):
        assert compute_score(chain.DATA_SOURCE, " ".join(chain.broken_chain(rng)), chain.COMPLETE) == -1.0
    with pytest.raises(ValueError, match="scores only"):
        compute_score("gsm8k", complete, chain.COMPLETE)


def test_the_kit_holds_long_answers_a_base_model_in_its_success_band_and_rows_the_reward_knows(kit):
    info = kit.info()
    assert info["spec"]["task"] == "chain" and kit.root.name == "chain"
    # The band the demo needs: both signs of advantage in most groups of 4 (measured 0.34 on 32 prompts).
    assert 0.15 <= info["warm_start_val_accuracy"] <= 0.6, info
    rows = pd.read_parquet(kit.train_files)
    assert len(rows) == CHAIN.train_prompts and set(rows["data_source"]) == {chain.DATA_SOURCE}
    assert {row["ground_truth"] for row in rows["reward_model"]} == {chain.COMPLETE}


def test_the_rollout_server_ends_each_answer_at_its_first_token_out_of_the_grammar(kit):
    config = OmegaConf.create(
        {
            "prompt_length": chain.MAX_PROMPT_TOKENS,
            "response_length": chain.MAX_RESPONSE_TOKENS,
            "seed": 0,
            "full_determinism": True,
            "custom": {"stop_rule": STOP_RULE},
        }
    )
    server = CPURolloutServer(config, OmegaConf.create({"path": str(kit.model)}))
    prompt = [VOCAB[chain.BOS], *_ids("3 1 4"), VOCAB[chain.PROMPT_SUFFIX]]

    async def serve():
        await server.set_global_steps(1)
        return [await server.generate(prompt, {"temperature": 1.5}, f"det-{i}") for i in range(12)]

    ended_by_break = 0
    for out in asyncio.run(serve()):
        tokens = out.token_ids
        breaks = [chain.ends_answer(i, t) for i, t in enumerate(tokens)]
        assert breaks[-1] or len(tokens) == chain.MAX_RESPONSE_TOKENS, tokens
        assert not any(breaks[:-1]), tokens  # nothing sampled after the first break
        ended_by_break += tokens[-1] != VOCAB[chain.EOS]
    assert ended_by_break > 0  # hot sampling breaks some answers off early


def test_without_the_stop_rule_the_server_samples_on_after_a_break(kit):
    config = OmegaConf.create({"prompt_length": 5, "response_length": chain.MAX_RESPONSE_TOKENS, "seed": 0})
    server = CPURolloutServer(config, OmegaConf.create({"path": str(kit.model)}))
    assert server.stop_rule is None
    prompt = [VOCAB[chain.BOS], *_ids("3 1 4"), VOCAB[chain.PROMPT_SUFFIX]]
    outs = [asyncio.run(server.generate(prompt, {"temperature": 1.5}, f"r{i}")) for i in range(6)]
    assert any(any(chain.ends_answer(i, t) for i, t in enumerate(o.token_ids[:-1])) for o in outs)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("respo_verl.cpu.kit.nope:ends_answer", "cannot load it"),
        ("respo_verl.cpu.kit.chain:nope", "cannot load it"),
        ("respo_verl.cpu.kit.chain:STEPS", "must name a function"),
    ],
)
def test_a_stop_rule_that_cannot_be_loaded_names_the_key(name, message):
    with pytest.raises(ValueError, match=rf"actor_rollout_ref.rollout.custom.stop_rule=.*{message}"):
        load_stop_rule(OmegaConf.create({"custom": {"stop_rule": name}}))
