"""Sampling from the policy (temperature 1, KV cache) and log-probabilities of sampled responses."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from experiments.mini import task
from experiments.mini.task import EOS, PAD, Prompts


@dataclass
class Rollout:
    """Prompts with one sampled response each (verl's layout: the G responses of a prompt are contiguous).

    Attributes:
        prompts: the prompts, one row per response.
        response: (B, T) sampled tokens, PAD after the end (``task.response_lengths``).
        response_mask: (B, T) bool, True up to and including the response's last token.
    """

    prompts: Prompts
    response: torch.Tensor
    response_mask: torch.Tensor

    def rows(self, index: slice | torch.Tensor) -> Rollout:
        return Rollout(self.prompts.rows(index), self.response[index], self.response_mask[index])


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids that skip left padding."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: Prompts,
    max_new_tokens: int,
    generator: torch.Generator,
    grammar: ModuleType = task,
) -> Rollout:
    """Sample one response per prompt row at temperature 1 (top-p 1, no top-k), with the model's KV cache.

    A response ends at ``<eos>`` or at its first token that breaks the task's grammar (``task.breaks_grammar``: an
    episode ends at an invalid action); the tokens after its end are PAD.

    Args:
        model: a causal LM returning ``logits`` and ``past_key_values``.
        prompts: (B, L) left-padded prompts.
        max_new_tokens: response budget; a response still going by then is cut there.
        generator: the only source of randomness of the sampling.
        grammar: the task's module (``tasks.Task.module``), whose ``breaks_grammar`` and ``response_lengths`` end
            the responses; the chain task's by default. Its ``<eos>`` and ``<pad>`` are the chain task's ids.
    """
    batch = prompts.input_ids.shape[0]
    attention_mask = prompts.attention_mask.clone()  # (B, L)
    out = model(
        input_ids=prompts.input_ids,
        attention_mask=attention_mask,
        position_ids=_positions(attention_mask),
        use_cache=True,
    )
    past = out.past_key_values
    next_pos = attention_mask.sum(dim=1, keepdim=True)  # (B, 1)
    tokens = []
    finished = torch.zeros(batch, dtype=torch.bool)
    logits = out.logits[:, -1].float()  # (B, V)
    for step in range(max_new_tokens):
        probs = torch.softmax(logits, dim=-1)  # (B, V)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
        token = torch.where(finished, PAD, token)
        tokens.append(token)
        finished |= (token == EOS) | grammar.breaks_grammar(token, step)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        attention_mask = torch.cat([attention_mask, torch.ones(batch, 1, dtype=attention_mask.dtype)], dim=1)
        out = model(
            input_ids=token.unsqueeze(1),
            attention_mask=attention_mask,
            position_ids=next_pos,
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        next_pos = next_pos + 1
        logits = out.logits[:, -1].float()
    response = torch.stack(tokens, dim=1)  # (B, T)
    if response.shape[1] < max_new_tokens:
        pad = torch.full((batch, max_new_tokens - response.shape[1]), PAD, dtype=response.dtype)
        response = torch.cat([response, pad], dim=1)
    lengths = grammar.response_lengths(response)  # (B,)
    response_mask = torch.arange(max_new_tokens).unsqueeze(0) < lengths.unsqueeze(1)  # (B, T)
    return Rollout(prompts, response, response_mask)


def response_log_prob(model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
    """log π(o_t | prompt, o_<t) of every response token, fp32 (grad flows when enabled).

    Returns:
        (B, T) log-probabilities; values on masked tokens are meaningless (the losses mask them).
    """
    prompt_len = rollout.prompts.input_ids.shape[1]
    input_ids = torch.cat([rollout.prompts.input_ids, rollout.response], dim=1)  # (B, L + T)
    attention_mask = torch.cat([rollout.prompts.attention_mask, rollout.response_mask.long()], dim=1)  # (B, L + T)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask)).logits
    # Position t of the logits predicts token t + 1: the response tokens are predicted from L − 1 .. L + T − 2.
    logits = logits[:, prompt_len - 1 : -1].float()  # (B, T, V)
    log_probs = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    return log_probs.gather(-1, rollout.response.unsqueeze(-1)).squeeze(-1)  # (B, T)


@torch.no_grad()
def response_log_prob_no_grad(model: torch.nn.Module, rollout: Rollout, rows: int = 64) -> torch.Tensor:
    """:func:`response_log_prob` without gradient, ``rows`` responses at a time (π_old of a whole rollout batch).

    The tiny model's forward is bound by memory traffic, not arithmetic: on one CPU core a rollout batch of 1024
    answers takes about 2.3 times as long in one piece as in pieces of 64 rows, with the same numbers
    (docs/mini.md, "How to rerun each verdict").
    """
    batch = rollout.response.shape[0]
    return torch.cat([response_log_prob(model, rollout.rows(slice(i, i + rows))) for i in range(0, batch, rows)])
