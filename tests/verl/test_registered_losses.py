"""The registered `respo` / `vespo` losses and the branch-ablation losses (`respo_pos`, `respo_neg`, `phi_one`) as verl
calls them: metrics, bad input, edge cases, host syncs."""

from __future__ import annotations

import json
import math
from typing import ClassVar

import pytest
import torch
from conftest import actor_config
from torch.utils._python_dispatch import TorchDispatchMode
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from respo_verl.core import diagnostic_keys
from respo_verl.core.diagnostics import INDEPENDENT_STARVED_MASS_KEY
from respo_verl.core.losses import KERNELS

KERNEL_LOSSES = list(KERNELS)
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.fixture(scope="module")
def configs():
    return {(engine, algo): actor_config(engine, algo) for engine in ("dp", "megatron") for algo in KERNEL_LOSSES}


def batch(seed=0, size=8, length=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(size, length, generator=g, dtype=dtype) * 2
    log_prob = (old + 0.2 * torch.randn(size, length, generator=g, dtype=dtype)).requires_grad_(True)
    lengths = torch.randint(1, length + 1, (size,), generator=g)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(size, 1, generator=g, dtype=dtype).expand(size, length) * mask
    return {"old_log_prob": old, "log_prob": log_prob, "advantages": adv, "response_mask": mask}


def call(name, cfg, data, agg="token-mean", **extra):
    return get_policy_loss_fn(name)(loss_agg_mode=agg, config=cfg, rollout_is_weights=None, **data, **extra)


@pytest.mark.parametrize("engine", ["dp", "megatron"])
@pytest.mark.parametrize("name", KERNEL_LOSSES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_every_agg_mode_gives_a_finite_loss_and_the_same_metric_keys(configs, engine, name, agg):
    # The loss's own diagnostics, and the measure every loss logs (respo_verl.verl.starvation).
    expected = {f"actor/{name}/{k}" for k in diagnostic_keys()} | {INDEPENDENT_STARVED_MASS_KEY}
    for seed in range(3):
        loss, metrics = call(name, configs[engine, name], batch(seed), agg)
        assert torch.isfinite(loss) and loss.dim() == 0
        assert set(metrics) == expected
        assert all(math.isfinite(float(v)) for v in metrics.values())
        assert all(isinstance(v, float) for k, v in metrics.items() if k != INDEPENDENT_STARVED_MASS_KEY)


@pytest.mark.parametrize("name", KERNEL_LOSSES)
@pytest.mark.parametrize("field", ["log_prob", "old_log_prob", "advantages"])
def test_non_finite_input_stops_with_the_tensor_and_count(configs, name, field):
    data = batch()
    bad = data[field].detach().clone()
    bad[0, 0], bad[1, 0] = math.nan, math.inf
    data[field] = bad
    with pytest.raises(FloatingPointError, match=rf"{field}: 2 of \d+ valid tokens"):
        call(name, configs["dp", name], data)


def test_shape_mismatch_raises(configs):
    data = batch()
    data["advantages"] = data["advantages"][:, :-1]
    with pytest.raises(ValueError, match="advantages has shape"):
        call("respo", configs["megatron", "respo"], data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(configs, dtype):
    data = batch(dtype=dtype)
    loss, _ = call("respo", configs["dp", "respo"], data)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert data["log_prob"].grad.dtype == dtype


@pytest.mark.parametrize("name", KERNEL_LOSSES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_degenerate_micro_batches_give_finite_loss_and_metrics(configs, name, agg):
    cfg = configs["dp", name]
    data = batch()
    data["response_mask"] = data["response_mask"].clone()
    data["response_mask"][2:5] = False  # zero-length responses among normal ones
    cases = {
        "zero_length_rows": data,
        "fully_masked": {**batch(), "response_mask": torch.zeros(8, 16, dtype=torch.bool)},
        "zero_advantages": {**batch(), "advantages": torch.zeros(8, 16)},
    }
    for case, d in cases.items():
        loss, metrics = call(name, cfg, d, agg)
        loss.backward()
        assert torch.isfinite(loss), case
        assert torch.isfinite(d["log_prob"].grad).all(), case
        assert all(math.isfinite(v) for v in metrics.values()), case
        if case != "zero_length_rows":
            assert loss.item() == 0.0, case


def test_missing_kernel_config_names_the_fix():
    from verl.workers.config import PolicyLossConfig

    cfg = actor_config("dp", "grpo")
    assert type(cfg.policy_loss) is PolicyLossConfig
    for name in KERNEL_LOSSES:
        with pytest.raises(TypeError, match=r"policy_loss._target_=respo_verl.verl.config.ReSPOPolicyLossConfig"):
            call(name, cfg, batch())


def test_ablation_losses_are_registered_and_their_presets_select_them(configs):
    from respo_verl.verl import losses

    for name in ("respo_pos", "respo_neg", "phi_one"):
        # Registered, then wrapped by the starved-mass measure (respo_verl.verl.starvation).
        assert get_policy_loss_fn(name).unmeasured is losses.REGISTERED[name]
        assert configs["dp", name].policy_loss.loss_mode == name


class _SyncCounter(TorchDispatchMode):
    """Counts aten ops that force a device-to-host synchronisation (data-dependent shapes or scalar reads)."""

    SYNCING: ClassVar[set[str]] = {
        "_local_scalar_dense",
        "nonzero",
        "masked_select",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
    }

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNCING:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", KERNEL_LOSSES)
def test_one_host_synchronisation_per_call(configs, name, monkeypatch):
    cfg = configs["megatron", name]
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=64, global_batch_size=8, loss_scale_factor=None)
    try:
        tolist_calls = []
        original = torch.Tensor.tolist

        def counting_tolist(self):
            tolist_calls.append(tuple(self.shape))
            return original(self)

        monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
        with _SyncCounter() as counter:
            call(name, cfg, batch())
        assert counter.ops == []
        assert len(tolist_calls) == 1
    finally:
        cfg.global_batch_info.clear()


@pytest.mark.parametrize("entry", ["respo", "verl"])
@pytest.mark.parametrize("algorithm", ["respo_pos", "respo_neg", "phi_one", "grpo_noclip"])
def test_ablation_presets_compose_validate_and_carry_the_default_kernels(entry, algorithm):
    from conftest import CPU_COMPOSE_OVERRIDES, compose
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from respo_verl.core.config import ReSPOConfig, VESPOConfig

    choice = f"algorithm={algorithm}" if entry == "respo" else f"+algorithm={algorithm}"
    cfg = compose([choice, *CPU_COMPOSE_OVERRIDES], entry=entry)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.loss_agg_mode == "token-mean" and not actor.use_kl_loss and actor.entropy_coeff == 0
    assert actor.ppo_epochs == 1 and not cfg.algorithm.use_kl_in_reward
    if algorithm == "grpo_noclip":
        assert (actor.policy_loss.loss_mode, cfg.algorithm.adv_estimator) == ("vanilla", "grpo")
        assert (actor.clip_ratio, actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (
            1e9, 1.0, 1e9, 1e9)  # fmt: skip
        return
    assert (actor.policy_loss.loss_mode, cfg.algorithm.adv_estimator) == (algorithm, "respo")
    # The YAML repeats the dataclass defaults (the same check as tests/verl/test_configs.py for respo / vespo).
    assert actor.policy_loss.respo == ReSPOConfig() and actor.policy_loss.vespo == VESPOConfig()


def test_the_kernel_trace_appends_each_call_s_sequences_to_the_path_it_names(configs, tmp_path, monkeypatch):
    from respo_verl.verl import losses

    monkeypatch.setenv(losses.TRACE_ENV, str(tmp_path / "trace.jsonl"))
    monkeypatch.setenv("RANK", "3")
    data = batch(seed=1)
    for _ in range(2):
        call("vespo", configs["dp", "vespo"], data)
    rows = [json.loads(line) for line in (tmp_path / "trace.jsonl.rank3").read_text().splitlines()]
    assert len(rows) == 2 and rows[0] == rows[1]
    n_tok = data["response_mask"].sum(-1).tolist()
    assert rows[0]["loss"] == "vespo" and rows[0]["n_tok"] == n_tok
    assert rows[0]["adv"] == pytest.approx(data["advantages"][:, 0].tolist())
    assert len(rows[0]["log_w"]) == len(rows[0]["phi"]) == len(n_tok)


def test_the_kernel_trace_beside_log_goes_beside_each_run_s_own_verl_log(configs, tmp_path, monkeypatch):
    """One shared value, ``beside-log``, and each run's trace next to its own log: ``<run>.trace.jsonl.rank<RANK>``."""
    from respo_verl.verl import losses

    monkeypatch.setenv(losses.TRACE_ENV, losses.TRACE_BESIDE_LOG)
    monkeypatch.delenv("RANK", raising=False)
    (tmp_path / "logs").mkdir()
    for run in ("cpu-respo-n16-s0", "cpu-vespo-n16-s0"):
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "logs" / f"{run}.jsonl"))
        call("respo", configs["dp", "respo"], batch())
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "cpu-respo-n16-s0.trace.jsonl.rank0",
        "cpu-vespo-n16-s0.trace.jsonl.rank0",
    ]
    assert losses.trace_path({losses.TRACE_ENV: "/x/t.jsonl", "VERL_FILE_LOGGER_PATH": "/y/l.jsonl"}) == "/x/t.jsonl"
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH")
    with pytest.raises(ValueError, match="beside-log puts the kernel trace beside verl's file log, but VERL_FILE_"):
        call("respo", configs["dp", "respo"], batch())
