"""The ``respo``/``vespo`` losses and the branch-ablation losses through verl's real ``ppo_loss``, as every verl engine
calls it; the ``grpo_noclip`` preset's vanilla loss without any clip acting.

The micro-batches are built the way verl's engines hand them to ``ppo_loss``: padded ``prompts``/``responses`` with an
``attention_mask`` (left-padded prompt, right-padded response), padded ``response_mask``/``old_log_probs``/
``advantages``, the model's log-probs as one flat (total_nnz,) tensor over the valid tokens of every sequence
(``no_padding_2_padding`` slices the response back out, shifted by one token), and the global batch info the engine
attaches to every micro-batch (``batch_num_tokens``: valid tokens of the whole mini-batch, ``global_batch_size``:
its number of sequences, ``dp_size``). The FSDP engine backpropagates the returned loss as is; the Megatron engine
multiplies it by ``num_micro_batch`` and Megatron's schedule divides by the same number, so both accumulate the plain
sum of micro-batch losses that these tests backpropagate.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from conftest import actor_config
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss

from respo_verl.core import diagnostic_keys, respo_phi
from respo_verl.core.losses import KERNELS
from respo_verl.verl.losses import METRIC_PREFIX

LOSSES = tuple(KERNELS)
# Every mode of verl's agg_loss, each with the loss_scale_factor it is used with (None: verl's default).
AGG_MODES = (
    ("token-mean", None),
    ("token-sum", None),
    ("seq-mean-token-sum", None),
    ("seq-mean-token-mean", None),
    ("seq-mean-token-sum-norm", None),
    ("seq-mean-token-sum-norm", 64),
)
MICRO_BATCH_SPLITS = (1, 2, 4)

BATCH_SIZE = 8
MAX_PROMPT_LEN = 5
MAX_RESPONSE_LEN = 7
# Log-probs in the padding of the flat model output and of the padded inputs: must never reach loss or gradient.
PADDING_GARBAGE = 11.0


@functools.cache
def _actor_config(model_engine: str, loss: str, loss_agg_mode: str, loss_scale_factor: int | None):
    overrides = [f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode}"]
    if loss_scale_factor is not None:
        overrides.append(f"actor_rollout_ref.actor.loss_scale_factor={loss_scale_factor}")
    config = actor_config(model_engine, loss, tuple(overrides))
    assert config.policy_loss.loss_mode == loss
    assert config.loss_agg_mode == loss_agg_mode
    assert config.loss_scale_factor == loss_scale_factor
    # ppo_loss adds these on top of the policy loss; the presets switch them off, so the gradient is the kernel's.
    assert not config.use_kl_loss and config.entropy_coeff == 0
    return config


class MiniBatch:
    """A synthetic mini-batch of ``BATCH_SIZE`` responses of varying lengths, in fp64.

    ``log_prob`` (B, T) is the leaf the gradients are taken with respect to; the flat model output of any group of
    rows is assembled from it, so every micro-batch's graph ends in this one tensor.
    """

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        b, p, t = BATCH_SIZE, MAX_PROMPT_LEN, MAX_RESPONSE_LEN
        self.prompt_len = torch.randint(1, p + 1, (b,), generator=gen)  # (B,)
        self.response_len = torch.randint(1, t + 1, (b,), generator=gen)  # (B,)
        self.response_len[0] = t  # at least one response fills the padded width
        positions = torch.arange(t)
        self.response_mask = positions < self.response_len.unsqueeze(-1)  # (B, T) bool
        prompt_mask = torch.arange(p).flip(0) < self.prompt_len.unsqueeze(-1)  # (B, P) left-padded
        self.attention_mask = torch.cat([prompt_mask, self.response_mask], dim=-1).long()  # (B, P + T)
        self.prompts = torch.randint(3, 100, (b, p), generator=gen)  # (B, P)
        self.responses = torch.randint(3, 100, (b, t), generator=gen)  # (B, T)

        old_log_prob = -3.0 * torch.rand(b, t, generator=gen, dtype=torch.float64)  # (B, T)
        # Token log-ratios of ±0.4 give sequence weights W from about e^-2 to e^2: both sides of W = 1.
        log_prob = old_log_prob + 0.4 * torch.randn(b, t, generator=gen, dtype=torch.float64)  # (B, T)
        adv_seq = torch.randn(b, generator=gen, dtype=torch.float64)  # (B,)
        adv_seq[:2] = torch.tensor([1.5, -1.5], dtype=torch.float64)  # both kernel branches present
        self.adv_seq = adv_seq
        # GRPO broadcasts the sequence advantage over its tokens.
        advantages_tok = adv_seq.unsqueeze(-1).expand(b, t).clone()  # (B, T)
        self.old_log_prob = torch.where(self.response_mask, old_log_prob, PADDING_GARBAGE)
        self.advantages = torch.where(self.response_mask, advantages_tok, PADDING_GARBAGE)
        self.log_prob = torch.where(self.response_mask, log_prob, 0.0).requires_grad_()  # leaf, (B, T)

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    def flat_log_probs(self, rows: range) -> torch.Tensor:
        """(total_nnz,) model output over the valid prompt+response tokens of ``rows``, as the engines return it.

        Position j of a sequence holds the log-prob of token j+1, so the response log-probs sit at
        [prompt_len − 1, prompt_len + response_len − 1) of each sequence, which is where ``no_padding_2_padding``
        reads them.
        """
        pieces = []
        for i in rows:
            p, r = int(self.prompt_len[i]), int(self.response_len[i])
            pieces.append(torch.full((p - 1,), PADDING_GARBAGE, dtype=torch.float64))
            pieces.append(self.log_prob[i, :r])
            pieces.append(torch.full((1,), PADDING_GARBAGE, dtype=torch.float64))
        return torch.cat(pieces)

    def micro_batch(self, rows: range, dp_size: int = 1) -> TensorDict:
        """The TensorDict ppo_loss receives for ``rows``, with the mini-batch's global batch info."""
        index = list(rows)
        data = TensorDict(
            {
                "prompts": self.prompts[index],
                "responses": self.responses[index],
                "attention_mask": self.attention_mask[index],
                "response_mask": self.response_mask[index].long(),
                "old_log_probs": self.old_log_prob[index],
                "advantages": self.advantages[index],
            },
            batch_size=[len(index)],
        )
        tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=self.num_tokens, global_batch_size=BATCH_SIZE)
        return data

    def loss(self, config, rows: range, dp_size: int = 1) -> tuple[torch.Tensor, dict]:
        return ppo_loss(config, {"log_probs": self.flat_log_probs(rows)}, self.micro_batch(rows, dp_size))


def _split(rows: range, n: int) -> list[range]:
    size = len(rows) // n
    assert size * n == len(rows)
    return [range(rows.start + k * size, rows.start + (k + 1) * size) for k in range(n)]


def _accumulate(batch: MiniBatch, config, n_micro: int) -> tuple[torch.Tensor, list[dict], list[float]]:
    """Backward every micro-batch loss into ``batch.log_prob``; returns the gradient, metrics and losses."""
    batch.log_prob.grad = None
    metrics, losses = [], []
    for rows in _split(range(BATCH_SIZE), n_micro):
        loss, micro_metrics = batch.loss(config, rows)
        assert loss.dim() == 0 and loss.dtype == torch.float64
        loss.backward()
        metrics.append(micro_metrics)
        losses.append(loss.item())
    return batch.log_prob.grad.clone(), metrics, losses


def _metric_value(value) -> float:
    """ppo_loss wraps policy-loss metrics in verl ``Metric`` objects holding one float per micro-batch."""
    assert isinstance(value, Metric), type(value)
    assert len(value.values) == 1
    (number,) = value.values
    assert isinstance(number, float) and math.isfinite(number)
    return number


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize(("loss_agg_mode", "loss_scale_factor"), AGG_MODES)
def test_micro_batching_does_not_change_the_gradient(model_engine, loss, loss_agg_mode, loss_scale_factor):
    config = _actor_config(model_engine, loss, loss_agg_mode, loss_scale_factor)
    batch = MiniBatch(seed=0)
    grads, total_losses = {}, {}
    for n_micro in MICRO_BATCH_SPLITS:
        grads[n_micro], metrics, losses = _accumulate(batch, config, n_micro)
        total_losses[n_micro] = sum(losses)

        expected_keys = {METRIC_PREFIX[loss] + key for key in diagnostic_keys()}
        for micro_metrics in metrics:
            assert set(micro_metrics) == set(metrics[0]), "every micro-batch must report the same metric keys"
            ours = {k: v for k, v in micro_metrics.items() if k.startswith(METRIC_PREFIX[loss])}
            assert set(ours) == expected_keys
            for value in ours.values():
                _metric_value(value)
                assert value.aggregation == AggregationType.MEAN
        # With global batch info the engine's SUM over micro-batches of actor/pg_loss is the mini-batch loss.
        pg_loss = Metric(AggregationType.SUM)
        for micro_metrics in metrics:
            assert micro_metrics["actor/pg_loss"].aggregation == AggregationType.SUM
            pg_loss.extend(micro_metrics["actor/pg_loss"])
        assert pg_loss.aggregate() == pytest.approx(total_losses[1], rel=1e-12, abs=1e-12)

    valid = batch.response_mask
    assert grads[1][valid].abs().min() > 0, "every valid token must receive gradient"
    assert torch.all(grads[1][~valid] == 0), "padding must receive no gradient"
    for n_micro in MICRO_BATCH_SPLITS[1:]:
        torch.testing.assert_close(grads[n_micro], grads[1], rtol=1e-12, atol=1e-14)
        assert total_losses[n_micro] == pytest.approx(total_losses[1], rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_data_parallel_split_matches_single_rank(loss, loss_agg_mode):
    """dp_size=2 ranks with 2 micro-batches each, averaged as DDP/FSDP do, equal one rank with the whole batch."""
    config = _actor_config("dp", loss, loss_agg_mode, None)
    batch = MiniBatch(seed=1)
    single, _, _ = _accumulate(batch, config, 1)

    dp_size = 2
    rank_grads = []
    for rank_rows in _split(range(BATCH_SIZE), dp_size):
        batch.log_prob.grad = None
        for rows in _split(rank_rows, 2):
            loss_value, _ = batch.loss(config, rows, dp_size=dp_size)
            loss_value.backward()
        rank_grads.append(batch.log_prob.grad.clone())
    all_reduced = torch.stack(rank_grads).mean(dim=0)
    torch.testing.assert_close(all_reduced, single, rtol=1e-12, atol=1e-14)


def _sequence_log_weight(batch: MiniBatch, log_w_clip: float, token_clip: float | None) -> torch.Tensor:
    """(B,) clamped Σ_t (log π − log μ) over valid tokens, recomputed here without the package."""
    delta = batch.log_prob.detach() - batch.old_log_prob  # (B, T)
    if token_clip is not None:
        delta = delta.clamp(-token_clip, token_clip)
    log_w = torch.stack([delta[i, : int(batch.response_len[i])].sum() for i in range(BATCH_SIZE)])  # (B,)
    return log_w.clamp(-log_w_clip, log_w_clip)


def _vespo_closed_form(w: torch.Tensor, k: float, lam: float) -> torch.Tensor:
    return w**k * torch.exp(lam * (1.0 - w))


def _expected_phi(loss: str, config, batch: MiniBatch) -> torch.Tensor:
    positive = batch.adv_seq >= 0  # (B,)
    respo, vespo = config.policy_loss.respo, config.policy_loss.vespo
    if loss == "respo":
        log_w = _sequence_log_weight(batch, respo.log_w_clip, None)
        return respo_phi(log_w, positive, respo)  # (B,)
    if loss == "phi_one":
        return torch.ones(BATCH_SIZE, dtype=torch.float64)
    # VESPO in closed form, φ(W) = W^k·exp(λ(1 − W)), not through the package's kernels; the hybrids form log W as
    # VESPO does (token clamp) and take ReSPO's default branches in closed form (docs/method.md §4.3).
    w = _sequence_log_weight(batch, vespo.log_w_clip, vespo.log_w_clip).exp()  # (B,)
    vespo_pos = _vespo_closed_form(w, vespo.k_pos, vespo.lambda_pos)
    vespo_neg = _vespo_closed_form(w, vespo.k_neg, vespo.lambda_neg)
    respo_pos = (1 + w) / 2 * torch.exp(1 - w)
    respo_neg = w.sqrt() * torch.exp(2 * (1 - w.sqrt()))
    pos, neg = {"vespo": (vespo_pos, vespo_neg), "respo_pos": (respo_pos, vespo_neg),
                "respo_neg": (vespo_pos, respo_neg)}[loss]  # fmt: skip
    return torch.where(positive, pos, neg)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("n_micro", [1, 4])
def test_token_mean_gradient_is_minus_phi_times_advantage_over_batch_tokens(model_engine, loss, n_micro):
    config = _actor_config(model_engine, loss, "token-mean", None)
    batch = MiniBatch(seed=2)
    grad, _, _ = _accumulate(batch, config, n_micro)

    phi = _expected_phi(loss, config, batch)  # (B,)
    assert torch.all(phi > 0)
    assert (loss == "phi_one") == torch.allclose(phi, torch.ones_like(phi)), "every kernel but φ ≡ 1 reshapes W"
    expected_tok = -phi.unsqueeze(-1) * batch.adv_seq.unsqueeze(-1) / batch.num_tokens  # (B, 1)
    expected = torch.where(batch.response_mask, expected_tok.expand_as(grad), 0.0)  # (B, T)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("n_micro", [1, 4])
def test_grpo_noclip_gradient_is_minus_the_token_ratio_times_advantage(model_engine, n_micro):
    """verl's vanilla loss under the grpo_noclip preset: neither the PPO clip (A > 0, r > 1 + ε) nor the dual clip
    (A < 0, r > c) acts at r = e^6 on every response's first token, so the gradient on every token is −r_t·A/n with
    r_t = exp(log π − log μ); the grpo preset clips the same batch."""
    batch = MiniBatch(seed=3)
    with torch.no_grad():
        batch.log_prob[:, 0] = batch.old_log_prob[:, 0] + 6.0  # column 0 is valid in every row
    ratio = torch.where(batch.response_mask, (batch.log_prob.detach() - batch.old_log_prob).exp(), 0.0)  # (B, T)
    expected = torch.where(batch.response_mask, -ratio * batch.adv_seq.unsqueeze(-1) / batch.num_tokens, 0.0)
    config = actor_config(model_engine, "grpo_noclip")
    assert config.policy_loss.loss_mode == "vanilla" and config.loss_agg_mode == "token-mean"
    assert (config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c) == (1.0, 1e9, 1e9)
    grad, _, _ = _accumulate(batch, config, n_micro)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    clipped, _, _ = _accumulate(batch, actor_config(model_engine, "grpo"), n_micro)
    assert not torch.allclose(clipped, expected)
