"""A rollout server whose inference engine died inside its living actor (vLLM's engine core process ended: Ray still
sees the server's actor alive). :func:`respo_verl.run.liveness.engine_dead` runs in the server's actor through Ray's
``__ray_call__``; here it reads stand-ins with the two attributes it reads of vLLM's ``AsyncLLM`` (``errored``,
``dead_error``), since an engine that died needs a vLLM engine core to kill: tests/cpu/test_cpu_vllm.py kills a real
one in a run."""

from __future__ import annotations

from types import SimpleNamespace

from respo_verl.run.liveness import engine_dead


class EngineDeadError(RuntimeError):
    pass


def test_a_server_whose_engine_errored_is_dead_with_the_engines_reason():
    engine = SimpleNamespace(errored=True, dead_error=EngineDeadError("EngineCore encountered an issue."))
    server = SimpleNamespace(engine=engine)
    assert engine_dead(server) == "SimpleNamespace, EngineDeadError: EngineCore encountered an issue."


def test_a_running_engine_and_a_server_without_one_are_not_dead():
    assert engine_dead(SimpleNamespace(engine=SimpleNamespace(errored=False))) is None
    assert engine_dead(SimpleNamespace(model=object())) is None  # the hf_cpu server samples in its own process
