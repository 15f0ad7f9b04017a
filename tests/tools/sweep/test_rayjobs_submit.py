"""The Ray executor's submission against a head whose job agent is not up yet.

A freshly started head answers on its dashboard before its job agent has registered, and Ray's client then raises
``RuntimeError("... No available agent to submit job, please try again later..")``. The end-to-end test
(test_sweep_ray.py) meets it only when the race falls that way, so these tests hand ``_submit`` a stand-in client
that refuses the first submissions with Ray's own message (no Ray involved).
"""

from __future__ import annotations

import pytest

from respo_verl.tools.sweep import rayjobs

REFUSAL = "Request failed with status code 500: No available agent to submit job, please try again later.."


class AgentNotUpYet:
    def __init__(self, refusals: int, error: str = REFUSAL):
        self.refusals, self.error, self.calls = refusals, error, []

    def submit_job(self, **job):
        self.calls.append(job)
        if len(self.calls) <= self.refusals:
            raise RuntimeError(self.error)
        return job["submission_id"]


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(rayjobs, "AGENT_RETRY_S", 0.0)


def test_a_submission_is_tried_again_until_the_agent_is_up():
    client = AgentNotUpYet(refusals=3)
    assert rayjobs._submit(client, entrypoint="true", submission_id="run-1") == "run-1"
    assert len(client.calls) == 4 and all(call == client.calls[0] for call in client.calls)


def test_an_agent_that_never_comes_is_an_error_naming_it():
    client = AgentNotUpYet(refusals=10**9)
    with pytest.raises(rayjobs.ClusterError, match=r"the Ray head had no job agent for 0 s .*No available agent"):
        rayjobs._submit(client, wait_s=0.0, entrypoint="true", submission_id="run-1")


def test_other_refusals_are_not_tried_again():
    client = AgentNotUpYet(refusals=1, error="Job with submission_id run-1 already exists.")
    with pytest.raises(RuntimeError, match="already exists"):
        rayjobs._submit(client, entrypoint="true", submission_id="run-1")
    assert len(client.calls) == 1
