"""The trainer's order of a step's samples: the data loader's order of their prompts, then session and index.

On TransferQueue's own ``KVBatchMeta`` (no Ray needed). The end-to-end consequence, two runs equal to the last bit in
every metric, is tested by tests/cpu/test_cpu_resume.py.
"""

from __future__ import annotations

import pytest
from transfer_queue.metadata import KVBatchMeta

from respo_verl.run.hooks import in_prompt_order


def _batch(keys: list[str]) -> KVBatchMeta:
    return KVBatchMeta(
        keys=keys,
        tags=[{"key": key} for key in keys],
        partition_id="train",
        fields=["responses"],
        extra_info={"temperature": 1.0},
    )


def test_samples_follow_the_data_loaders_prompt_order_then_session_and_index():
    order = {"b-2": 0, "a-1": 1}  # the data loader gave b-2 first: not alphabetical
    finished = ["a-1_1_0", "b-2_10_0", "a-1_0_0", "b-2_2_0", "b-2_2_1"]  # the order the rollouts finished in
    ordered = in_prompt_order(_batch(finished), order)
    assert ordered.keys == ["b-2_2_0", "b-2_2_1", "b-2_10_0", "a-1_0_0", "a-1_1_0"]  # sessions compared as numbers
    assert [tag["key"] for tag in ordered.tags] == ordered.keys
    assert (ordered.partition_id, ordered.fields, ordered.extra_info) == ("train", ["responses"], {"temperature": 1.0})


def test_the_order_does_not_depend_on_the_order_the_rollouts_finished():
    order = {"p": 0, "q": 1, "r": 2}
    keys = [f"{uid}_{session}_0" for uid in order for session in range(4)]
    reference = in_prompt_order(_batch(keys), order).keys
    assert reference == keys
    for shift in range(1, len(keys)):
        assert in_prompt_order(_batch(keys[shift:] + keys[:shift]), order).keys == reference


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("u-1_0", "is not verl's"),
        ("u-1_x_0", "is not verl's"),
        ("stranger_0_0", "its prompt 'stranger' did not come from the train data loader"),
    ],
)
def test_a_key_it_cannot_place_is_named(key, match):
    with pytest.raises(ValueError, match=match):
        in_prompt_order(_batch(["u-1_0_0", key]), {"u-1": 0})
