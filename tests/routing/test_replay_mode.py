"""Routing replay's mode: verl's router_replay.mode read into off|r2|r3 at one place (respo_verl/routing/mode.py)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from respo_verl.routing.mode import REPLAY_KEY, REPLAY_MODES, mode_of, replay_mode, verl_mode
from respo_verl.run.compose import compose_job


@pytest.mark.parametrize("preset", REPLAY_MODES)
def test_each_routing_preset_reads_back_as_its_own_name(preset):
    job = compose_job("respo", ["algorithm=respo", "model_engine=megatron", f"routing={preset}"])
    assert replay_mode(job) == preset
    assert OmegaConf.select(job, REPLAY_KEY, default="disabled") == verl_mode(preset)


def test_a_job_without_the_key_is_off_and_a_value_verl_refuses_is_one_line():
    assert replay_mode(OmegaConf.create({})) == "off" and mode_of(None) == "off"
    with pytest.raises(ValueError) as info:
        mode_of("r2")  # the preset's name, not verl's
    assert str(info.value) == f"{REPLAY_KEY}=r2: verl takes disabled, R2, R3"
