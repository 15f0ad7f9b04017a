"""The route-drift Megatron engine (``respo_verl/routing/engine.py``): metrics, registration, selection.

verl's ``MegatronEngine`` needs CUDA and NCCL to be built, so these tests use the real subclass with an instance made
by ``object.__new__`` that carries only what the subclass reads (``module``, ``enable_routing_replay``,
``tf_config``, ``is_mp_src_rank_with_outputs``), and replace verl's own ``forward_backward_batch`` body (for the
test only) by a stand-in: it runs a tiny megatron-core GPTModel on CPU (gloo world of size 1) under megatron's routing
replay, the way verl drives the routers (set the replay data, set REPLAY_FORWARD, forward, clear), and returns the
dict shape verl's method returns. The stand-in replaces the CUDA-only engine body; the subclass, the monitor, the
reduction and the metric keys are the real code.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from respo_verl.cpu.kit.megatron_moe import (
    BATCH,
    NUM_EXPERTS,
    NUM_LAYERS,
    SEQ,
    VOCAB,
    forward,
    megatron_cpu,
    tiny_gpt_moe,
)
from respo_verl.routing import engine as route_drift
from respo_verl.routing.megatron import find_replay_routers

TOKENS = BATCH * SEQ
LAST = NUM_LAYERS - 1


@pytest.fixture(scope="module", autouse=True)
def cpu_world():
    with megatron_cpu():
        yield


@pytest.fixture
def engine_cls(monkeypatch):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    monkeypatch.setattr(MegatronEngine, "forward_backward_batch", _stand_in)  # verl's CUDA-only body, for the test
    return route_drift.engine_classes()["language_model"]


def _stand_in(self, data, loss_function, forward_only=False):
    """Stands in for verl's CUDA-only ``forward_backward_batch``: replay (if the batch asks for it), forward, clear."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = find_replay_routers(self.module)
    replay = tu.get_non_tensor_data(data, key="enable_routing_replay", default=False)
    if replay:
        for layer, router in routers.items():
            if layer in self.routes:
                router.router_replay.set_target_indices(self.routes[layer])
            router.router_replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD
    try:
        with torch.set_grad_enabled(not forward_only):
            logits = forward(self.module[0], data["input_ids"])
    finally:
        for router in routers.values():
            router.router_replay.clear_indices()
            router.router_replay.router_replay_action = None
    return {"model_output": {"logits": logits.detach()}, "loss": [0.5], "metrics": {"pg_loss": [0.25]}}


def _engine(engine_cls, model, routes, replay: bool = True):
    engine = object.__new__(engine_cls)
    engine.module = [model]
    engine.enable_routing_replay = replay
    engine.tf_config = model.config
    engine.is_mp_src_rank_with_outputs = lambda: True
    engine.routes = routes  # read by the stand-in only
    return engine


def _batch(input_ids, replay: bool = True) -> TensorDict:
    data = TensorDict({"input_ids": input_ids}, batch_size=[input_ids.shape[0]])
    tu.assign_non_tensor(data, enable_routing_replay=replay)
    return data


def _native_routes(model, input_ids):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = find_replay_routers(model)
    for router in routers.values():
        router.router_replay.router_replay_action = RouterReplayAction.RECORD
    with torch.no_grad():
        forward(model, input_ids)
    routes = {layer: r.router_replay.recorded_topk_idx.clone() for layer, r in routers.items()}
    for router in routers.values():
        router.router_replay.clear_indices()
        router.router_replay.router_replay_action = None
    return routes


def _flip(routes, layer: int, num: int):
    flipped = {key: value.clone() for key, value in routes.items()}
    for t in range(num):
        flipped[layer][t, -1] = next(e for e in range(NUM_EXPERTS) if e not in routes[layer][t].tolist())
    return flipped


@pytest.fixture
def input_ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("flips", [1, 5])
def test_update_reports_exact_drift_under_routing_keys(engine_cls, input_ids, flips):
    model = tiny_gpt_moe()
    routes = _native_routes(model, input_ids)
    engine = _engine(engine_cls, model, _flip(routes, LAST, flips))
    output = engine.forward_backward_batch(_batch(input_ids), None, forward_only=False)
    metrics = output["metrics"]
    assert metrics["pg_loss"] == [0.25] and output["loss"] == [0.5]  # verl's own metrics untouched
    assert metrics[f"routing/flip_frac/layer_{LAST}"] == [flips / TOKENS]
    assert metrics["routing/any_layer_flip_frac"] == [flips / TOKENS]
    assert metrics["routing/replayed_tokens"] == [TOKENS]
    for layer in range(LAST):  # upstream layers see unchanged inputs
        assert metrics[f"routing/flip_frac/layer_{layer}"] == [0.0]
    assert metrics["routing/flip_frac"] == [pytest.approx(flips / (TOKENS * NUM_LAYERS))]
    assert not [key for key in metrics if key.startswith(("actor/", "routing/compute_log_prob"))]
    # every value is a one-element list, the shape verl's worker flattens and its trainer averages
    assert all(isinstance(value, list) and len(value) == 1 for value in metrics.values())


def test_forward_only_drift_is_reported_with_the_next_update(engine_cls, input_ids):
    model = tiny_gpt_moe()
    routes = _native_routes(model, input_ids)
    engine = _engine(engine_cls, model, _flip(routes, LAST, 3))
    output = engine.forward_backward_batch(_batch(input_ids), None, forward_only=True)  # compute_log_prob (R3)
    assert not [key for key in output["metrics"] if key.startswith("routing/")]
    engine.routes = routes  # the update replays without drift
    metrics = engine.forward_backward_batch(_batch(input_ids), None, forward_only=False)["metrics"]
    assert metrics["routing/flip_frac"] == [0.0]
    assert metrics[f"routing/compute_log_prob/flip_frac/layer_{LAST}"] == [3 / TOKENS]
    assert metrics["routing/compute_log_prob/replayed_tokens"] == [TOKENS]
    again = engine.forward_backward_batch(_batch(input_ids), None, forward_only=False)["metrics"]
    assert not [key for key in again if key.startswith("routing/compute_log_prob")]  # reported once


def test_the_bytes_of_r3_s_routes_are_reported_with_the_next_update(engine_cls, input_ids):
    """R3's compute_log_prob receives the rollout's routes, uint8 and jagged as the TransferQueue hands them over
    (tests/patches/test_uint8_routes.py); the next update reports their bytes, per sample, and the most one rank
    received (a world of one rank here), once."""
    model = tiny_gpt_moe()
    routes = _native_routes(model, input_ids)
    routed = torch.stack([routes[layer].reshape(BATCH, SEQ, -1) for layer in range(NUM_LAYERS)], dim=2)
    data = _batch(input_ids)
    data["routed_experts"] = torch.nested.nested_tensor([routed[0, :4], routed[1]], layout=torch.jagged).to(torch.uint8)
    engine = _engine(engine_cls, model, routes)
    engine.engine_config = types.SimpleNamespace(dynamic_context_parallel=False)  # verl's data-parallel group
    engine.forward_backward_batch(data, None, forward_only=True)
    metrics = engine.forward_backward_batch(_batch(input_ids), None, forward_only=False)["metrics"]
    size = (4 + SEQ) * NUM_LAYERS * routed.shape[-1]  # one byte per expert id
    assert metrics["routing/compute_log_prob/route_bytes"] == [size]
    assert metrics["routing/compute_log_prob/route_bytes_per_sample"] == [size / 2]
    assert metrics["routing/compute_log_prob/route_bytes_max_rank"] == [size]
    again = engine.forward_backward_batch(_batch(input_ids), None, forward_only=False)["metrics"]
    assert "routing/compute_log_prob/route_bytes" not in again


def _update_pass(engine, input_ids, routes, flips_by_update: list[int]) -> dict[str, float]:
    """One step's update pass as verl's worker runs it: one training call per mini-batch, the last one flagged
    ``update_lr_scheduler``; the metrics collected per key over the mini-batches and reduced by verl's own
    ``reduce_metrics`` (the trainer's mean). Mini-batch j replays ``routes`` with ``flips_by_update[j]`` tokens of
    the last layer flipped."""
    from verl.utils.metric import reduce_metrics

    step: dict[str, list[float]] = {}
    for j, flips in enumerate(flips_by_update):
        engine.routes = _flip(routes, LAST, flips)
        data = _batch(input_ids)
        tu.assign_non_tensor(data, update_lr_scheduler=j == len(flips_by_update) - 1)
        for key, value in engine.forward_backward_batch(data, None, forward_only=False)["metrics"].items():
            step.setdefault(key, []).extend(value)
    return reduce_metrics(step)


def test_each_update_index_is_logged_on_its_own_and_the_mean_is_kept(engine_cls, input_ids):
    """A hand-built pass of N = 4 updates whose replayed routes grow staler: update j flips 3j tokens."""
    model = tiny_gpt_moe()
    routes = _native_routes(model, input_ids)
    engine = _engine(engine_cls, model, routes)
    flips = [0, 3, 6, 9]
    for _ in range(2):  # the second step's pass starts again at j = 0
        metrics = _update_pass(engine, input_ids, routes, flips)
        for j, n in enumerate(flips):
            assert metrics[f"routing/by_update/j{j}/flip_frac"] == pytest.approx(n / (TOKENS * NUM_LAYERS))
            assert metrics[f"routing/by_update/j{j}/any_layer_flip_frac"] == pytest.approx(n / TOKENS)
            assert metrics[f"routing/by_update/j{j}/overlap"] == pytest.approx(1 - n / (TOKENS * NUM_LAYERS * 2))
            assert metrics[f"routing/by_update/j{j}/replayed_tokens"] == TOKENS
            assert metrics[f"routing/by_update/j{j}/prob_mass_delta"] <= 0
        assert metrics["routing/by_update/j0/prob_mass_delta"] == 0
        assert metrics["routing/flip_frac"] == pytest.approx(18 / 4 / (TOKENS * NUM_LAYERS))  # the mean, as before
        assert metrics["routing/any_layer_flip_frac"] == pytest.approx(18 / 4 / TOKENS)
        by_update = {key for key in metrics if "/by_update/" in key}
        assert len(by_update) == 4 * 5  # no per-layer key per update, no update beyond N − 1
        assert engine._route_drift.update_index == 0
    # A caller that flags no last mini-batch: the next rollout batch's forward-only pass starts j again.
    for expected in ("j0", "j1"):
        metrics = engine.forward_backward_batch(_batch(input_ids), None, forward_only=False)["metrics"]
        assert [key for key in metrics if key.endswith("/flip_frac") and "by_update" in key] == [
            f"routing/by_update/{expected}/flip_frac"
        ]
    engine.forward_backward_batch(_batch(input_ids), None, forward_only=True)
    metrics = engine.forward_backward_batch(_batch(input_ids), None, forward_only=False)["metrics"]
    assert "routing/by_update/j0/flip_frac" in metrics


def test_nothing_installed_when_replay_is_off(engine_cls, input_ids):
    model = tiny_gpt_moe()
    routes = _native_routes(model, input_ids)
    for engine, data in (
        (_engine(engine_cls, model, routes, replay=False), _batch(input_ids)),  # router_replay.mode=disabled
        (_engine(engine_cls, model, routes), _batch(input_ids, replay=False)),  # e.g. compute_ref_log_prob
    ):
        output = engine.forward_backward_batch(data, None, forward_only=False)
        assert output["metrics"] == {"pg_loss": [0.25]}
        replays = [r.router_replay for r in find_replay_routers(model).values()]
        assert all(not hasattr(replay, "_respo_route_drift_monitor") for replay in replays)


def test_the_monitor_is_attached_once_per_model(engine_cls, input_ids):
    model = tiny_gpt_moe()
    engine = _engine(engine_cls, model, _native_routes(model, input_ids))
    engine.forward_backward_batch(_batch(input_ids), None)
    monitor = engine._route_drift.monitor
    engine.forward_backward_batch(_batch(input_ids), None)  # attached once, not twice
    assert engine._route_drift.monitor is monitor
    replays = [r.router_replay for r in find_replay_routers(model).values()]
    assert all(hasattr(replay, "_respo_route_drift_monitor") for replay in replays)
    other = tiny_gpt_moe(seed=1)
    engine.module = [other]  # the engine rebuilt its model: the old routers are unhooked
    engine.routes = _native_routes(other, input_ids)
    engine.forward_backward_batch(_batch(input_ids), None)
    assert all(not hasattr(replay, "_respo_route_drift_monitor") for replay in replays)
    assert "get_replay_topk" not in vars(replays[0])  # the class method is back


def test_missing_replay_data_for_a_layer_names_the_layer(engine_cls, input_ids):
    model = tiny_gpt_moe()
    routes = _native_routes(model, input_ids)
    del routes[1]
    with pytest.raises(ValueError, match=r"layer 1: REPLAY_FORWARD but no replay data"):
        _engine(engine_cls, model, routes).forward_backward_batch(_batch(input_ids), None)


def test_the_presets_vendor_selects_the_route_drift_engine_and_removal_unregisters_it(monkeypatch):
    """verl's own ``VERL_ENGINE_VENDOR`` picks the subclass; other vendors, and no vendor, get verl's engine."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from respo_verl.verl import plugin

    assert plugin.ROUTE_DRIFT_ENGINES is route_drift.REGISTRATION and route_drift.REGISTRATION.applied
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    monkeypatch.setenv(route_drift.VENDOR_ENV, route_drift.VENDOR)
    chosen = EngineRegistry.get_engine_cls("language_model", "megatron")
    assert issubclass(chosen, route_drift.RouteDriftEngine) and issubclass(chosen, MegatronEngineWithLMHead)
    assert issubclass(EngineRegistry.get_engine_cls("value_model", "megatron"), route_drift.RouteDriftEngine)
    monkeypatch.delenv(route_drift.VENDOR_ENV)
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is MegatronEngineWithLMHead
    try:
        assert route_drift.REGISTRATION.remove() is True
        monkeypatch.setenv(route_drift.VENDOR_ENV, route_drift.VENDOR)
        assert EngineRegistry.get_engine_cls("language_model", "megatron") is MegatronEngineWithLMHead
    finally:
        route_drift.REGISTRATION.apply()  # the module is imported: registers again at once
    assert issubclass(EngineRegistry.get_engine_cls("language_model", "megatron"), route_drift.RouteDriftEngine)


@pytest.mark.slow
def test_the_plugin_registers_the_engines_only_once_verl_imports_its_megatron_engine():
    """A process that imports verl (driver, TaskRunner, rollout) imports nothing of Megatron through the plugin."""
    code = (
        "import sys, verl, respo_verl.verl.plugin\n"
        "from respo_verl.run.preflight import registered\n"
        "print('megatron.core' in sys.modules, registered()['engine/route_drift'])\n"
        "from verl.workers.engine.base import EngineRegistry  # imports every engine module of verl\n"
        "print(('cuda', 'respo_route_drift') in EngineRegistry._engines['language_model']['megatron'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["False", "True", "True"]


def test_the_engine_does_not_let_unconsumed_replay_data_pass_although_verl_clears_it(engine_cls, input_ids):
    """verl clears the routers' replay data at the end of its method, so the check tracks what was set."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    model = tiny_gpt_moe()
    routes = _native_routes(model, input_ids)
    engine = _engine(engine_cls, model, routes)

    def set_twice_forward_once(self, data, loss_function, forward_only=False):
        routers = find_replay_routers(self.module)
        for router in routers.values():
            router.router_replay.set_target_indices(self.routes[0])
        router = routers[LAST]
        router.router_replay.set_target_indices(self.routes[LAST])  # replaces data no forward used
        try:
            for router in routers.values():
                router.router_replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD
            forward(self.module[0], data["input_ids"])
        finally:
            for router in routers.values():
                router.router_replay.clear_indices()
                router.router_replay.router_replay_action = None
        return {"model_output": {}, "loss": [0.5], "metrics": {}}

    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    MegatronEngine.forward_backward_batch = set_twice_forward_once  # the fixture restores verl's body
    with pytest.raises(ValueError, match=rf"unconsumed .*layer {LAST} \({TOKENS}, 2\) \(replaced before use\)"):
        engine.forward_backward_batch(_batch(input_ids), None, forward_only=False)


@pytest.mark.parametrize("bad", [NUM_EXPERTS, -1])
def test_routed_experts_out_of_range_are_refused_on_the_host_naming_the_layer(engine_cls, input_ids, bad):
    """verl's batch carries the whole mini-batch's routes as ``routed_experts`` (batch, tokens, layers, topk); a bad
    index is reported before any forward, with the layer, on CPU and CUDA alike."""
    model = tiny_gpt_moe()
    routes = _native_routes(model, input_ids)
    routed = torch.stack([routes[layer].reshape(BATCH, SEQ, -1) for layer in range(NUM_LAYERS)], dim=2)
    routed[1, 3, 1, 0] = bad
    data = _batch(input_ids)
    data["routed_experts"] = routed
    engine = _engine(engine_cls, model, routes)
    with pytest.raises(ValueError, match=rf"outside \[0, {NUM_EXPERTS}\) in layer\(s\) \[1\] of their layer dimension"):
        engine.forward_backward_batch(data, None, forward_only=False)
    # Checked here on the host, so its routers skip their own index check (a host sync per router on CUDA).
    assert engine.__dict__["_route_drift"].monitor.index_checked_on_host
    nested = torch.nested.nested_tensor([routed[0, :4], routed[1]], layout=torch.jagged)
    data = _batch(input_ids)
    data["routed_experts"] = nested
    with pytest.raises(ValueError, match=r"in layer\(s\) \[1\]"):
        _engine(engine_cls, model, routes).forward_backward_batch(data, None, forward_only=False)


_BROKEN_ENGINE = """
import importlib.abc, sys

class _Broken(importlib.abc.MetaPathFinder):
    # Stands in for a Transformer Engine or flash-attn build that fails at import with a RuntimeError.
    def find_spec(self, fullname, path, target=None):
        if fullname == "verl.workers.engine.megatron.transformer_impl":
            raise RuntimeError("transformer_engine: undefined symbol (stand-in)")
        return None

sys.meta_path.insert(0, _Broken())
"""


def _in_subprocess(code: str, tmp_path, prelude: str = "") -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(prelude)
    env = {
        **__import__("os").environ,
        "PYTHONPATH": str(tmp_path),
        "VERL_USE_EXTERNAL_MODULES": "respo_verl.verl.plugin",  # as the presets' Ray runtime env sets it
    }
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_a_broken_megatron_engine_stops_the_trainer_with_its_cause_and_leaves_the_rollout_alone(tmp_path):
    rollout = _in_subprocess(
        "import verl, respo_verl.verl.plugin; from respo_verl.run.preflight import registered; "
        "print(sorted(k for k, v in registered().items() if v))",
        tmp_path,
        _BROKEN_ENGINE,
    )
    assert rollout.returncode == 0, rollout.stderr[-3000:]
    assert "policy_loss/respo" in rollout.stdout and "engine/route_drift" in rollout.stdout
    trainer = _in_subprocess("import verl; import verl.workers.engine", tmp_path, _BROKEN_ENGINE)
    assert trainer.returncode != 0
    assert "RuntimeError: transformer_engine: undefined symbol (stand-in)" in trainer.stderr


@pytest.mark.slow
def test_a_failed_route_drift_registration_is_not_hidden_as_a_missing_megatron_engine(tmp_path):
    """verl turns an ImportError of its Megatron engine into a warning; a registration that fails with one (for
    example a verl whose engine classes were renamed) must stop the trainer, naming the cause."""
    code = (
        "import verl\n"
        "from respo_verl.routing import engine\n"
        "def renamed(*mixins):\n"
        "    raise ImportError('cannot import name MegatronEngineWithLMHead (stand-in)')\n"
        "engine.engine_classes = renamed\n"
        "import verl.workers.engine\n"
    )
    out = _in_subprocess(code, tmp_path)
    assert out.returncode != 0, out.stderr[-3000:]
    assert "RouteDriftRegistrationError: respo-verl could not register its route-drift Megatron engines" in out.stderr
    assert "ImportError: cannot import name MegatronEngineWithLMHead (stand-in)" in out.stderr
