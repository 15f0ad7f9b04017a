"""A CPU rollout for verl 0.9.1: an HF ``transformers`` sampling server behind verl's agent loop.

- verl version: 0.9.1.
- Why: verl's rollouts are vLLM, SGLang and TensorRT-LLM servers, none of which runs on a CPU (verl's old
  ``hf_rollout.py`` no longer matches ``BaseRollout``). This module adds a rollout named ``hf_cpu`` with the three
  pieces verl expects of a server rollout:

  * :class:`CPURolloutServer`, a Ray actor with the token-in/token-out ``generate`` method and the control methods
    of verl's vLLM server (wake_up, sleep, clear_kv_cache, abort_all_requests, ...). It samples one token at a time
    with a KV cache at the requested temperature/top-p/top-k and returns each sampled token's log-probability under
    the temperature-scaled distribution (the quantity verl's actor recomputes as ``old_log_prob``).
  * :class:`CPURolloutReplica`, the ``RolloutReplica`` that starts one server per replica, registered through verl's
    public ``RolloutReplicaRegistry``.
  * :class:`CPURolloutAdapter`, the ``BaseRollout`` living in each actor worker. verl's naive checkpoint engine
    hands it the trainer's full tensors after every update; the rollout rank sends them to its server, which loads
    them with a strict name and shape check. verl keeps this class table in the private ``_ROLLOUT_REGISTRY`` dict of
    ``verl.workers.rollout.base`` (no public registration function exists): that one entry is the only write to
    a verl table that is not public.

- Registered by :func:`respo_verl.cpu.runtime.enable` (the ``+device=cpu`` presets), never on import.
- Delete when: verl ships a CPU rollout (or a public rollout-class registry, which would remove the private entry).

With ``enable_rollout_routing_replay`` (``routing=r3``) on an MoE model, the server also returns the experts each of
its forwards chose, as verl's vLLM server does: ``TokenOutput.routed_experts``, an int16 array (prompt length +
response length - 1, MoE layers, top-k) with the routes of every token fed to the model (the last sampled token is
never fed), recorded with :class:`respo_verl.routing.hf.RoutingReplay`.

With ``actor_rollout_ref.rollout.full_determinism=true`` (verl's own switch: its single-turn agent loop then names
each request ``det-<priority>``, and the CPU runtime's
:data:`~respo_verl.patches.verl_0_9_1.SAMPLE_REQUEST_IDS` gives every sample a priority of its own where verl's
TransferQueue agent loop passes none), every request samples from a generator of its own, seeded from the rollout seed,
the training step and the request id (:func:`request_generator`), so the order in which the agent loop's requests
reach the server no longer matters: two runs with one seed sample the same responses, and a resumed run samples what
the uninterrupted one did. Otherwise the server's one generator, seeded at start-up, serves requests as they come.

With ``actor_rollout_ref.rollout.custom.stop_rule=<module>:<function>`` (verl's extension point for custom rollout
settings), the server ends a response right after the first token for which ``function(position, token_id)`` is true
(the token is kept; ``position`` counts response tokens from 0), as an agent loop ends an episode at an invalid action:
for example :func:`respo_verl.cpu.kit.chain.ends_answer`, the chain task's grammar.

Not exercised by this rollout: vLLM/SGLang scheduling, prefix caching, CUDA-IPC weight transfer, multi-modal inputs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import ray
import torch

from respo_verl.cpu import ROLLOUT_NAME
from respo_verl.patches import ray_private

ROLLOUT_MODE = "async"
ADAPTER_FQN = f"{__name__}.CPURolloutAdapter"

logger = logging.getLogger(__name__)


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_weights(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF checkpoint layout (one tensor per expert and projection) -> transformers 5's in-memory expert layout.

    mbridge exports Qwen3-MoE experts as a checkpoint stores them (``...mlp.experts.<e>.{gate,up,down}_proj.weight``,
    what vLLM's loader reads); transformers 5 holds them fused per layer, ``...mlp.experts.gate_up_proj``
    (experts, 2 * moe_intermediate, hidden; gate rows first) and ``...mlp.experts.down_proj`` (experts, hidden,
    moe_intermediate), which is what the hf_cpu rollout server loads. Other tensors pass through unchanged; the fused
    ones follow once the stream ends (the server takes a whole state dict). The trainer sends the checkpoint's layout,
    the one vLLM's loader reads (it skips any other expert name without a word).
    """
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in named_tensors:
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
        experts.setdefault(prefix, {}).setdefault(projection, {})[expert] = tensor
    for prefix, projections in experts.items():
        ids = sorted(projections.get("down_proj", {}))
        if ids != list(range(len(ids))) or any(sorted(projections.get(p, {})) != ids for p in ("gate_proj", "up_proj")):
            raise ValueError(
                f"{prefix}: the exported experts are incomplete ({ {p: sorted(v) for p, v in projections.items()} })"
            )
        gate_up = [torch.cat([projections["gate_proj"][e], projections["up_proj"][e]], dim=0) for e in ids]
        yield f"{prefix}.gate_up_proj", torch.stack(gate_up)  # (E, 2I, H)
        yield f"{prefix}.down_proj", torch.stack([projections["down_proj"][e] for e in ids])  # (E, H, I)


def _server_name(replica_rank: int, node_rank: int = 0) -> str:
    return f"{ROLLOUT_NAME}_server_{replica_rank}_{node_rank}"


STOP_RULE_KEY = "stop_rule"


def load_stop_rule(config) -> Any:
    """The callable named by ``config.custom.stop_rule`` (``module:function``), or None when none is set."""
    import importlib

    custom = getattr(config, "custom", None) or {}
    name = custom.get(STOP_RULE_KEY) if hasattr(custom, "get") else None
    if not name:
        return None
    module, _, function = str(name).partition(":")
    try:
        rule = getattr(importlib.import_module(module), function) if function else None
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"actor_rollout_ref.rollout.custom.{STOP_RULE_KEY}={name!r}: cannot load it ({type(exc).__name__}: {exc})"
        ) from exc
    if not callable(rule):
        raise ValueError(
            f"actor_rollout_ref.rollout.custom.{STOP_RULE_KEY}={name!r} must name a function as module:function"
        )
    return rule


def request_generator(seed: int, global_steps: int | None, request_id: str) -> torch.Generator:
    """The generator of one request in deterministic mode: a function of (seed, step, request id) only."""
    digest = hashlib.sha256(f"{int(seed)}/{global_steps}/{request_id}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator):
    """One token from ``logits`` (V,) and its log-probability under softmax(logits / temperature).

    Greedy when ``temperature`` is 0. top-k (k > 0) and top-p (< 1) truncate the sampling distribution only; the
    returned log-probability is that of the untruncated tempered distribution, as verl's actor computes it.
    """
    if temperature <= 0:
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # (V,)
        token = int(torch.argmax(log_probs))
        return token, float(log_probs[token])
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)  # (V,)
    keep = torch.ones_like(log_probs, dtype=torch.bool)  # (V,)
    if top_k is not None and top_k > 0:
        kth = torch.topk(log_probs, min(int(top_k), log_probs.numel())).values[-1]
        keep &= log_probs >= kth
    if top_p is not None and top_p < 1.0:
        order = torch.argsort(log_probs, descending=True)
        mass_before = torch.cumsum(log_probs[order].exp(), dim=0) - log_probs[order].exp()
        nucleus = torch.zeros_like(keep)
        nucleus[order] = mass_before < top_p  # the smallest prefix whose mass reaches top_p
        keep &= nucleus
    weights = torch.where(keep, log_probs.exp(), torch.zeros_like(log_probs))
    token = int(torch.multinomial(weights, 1, generator=generator))
    return token, float(log_probs[token])


class CPURolloutServer:
    """Token-in/token-out sampling with an HF causal LM on CPU (one Ray actor per rollout replica).

    Args mirror verl's vLLM server actor so that the replica can start it the same way; only ``config`` (the rollout
    config), ``model_config`` (``HFModelConfig``) and ``replica_rank`` are used.
    """

    def __init__(
        self, config, model_config, rollout_mode=None, workers=None, replica_rank: int = 0, node_rank: int = 0, **_
    ):
        from transformers import AutoModelForCausalLM

        self.config = config
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.global_steps = None
        self.weight_updates = 0
        # The replica passes the raw model node (DictConfig) rather than verl's HFModelConfig.
        local = model_config.get("local_path") if hasattr(model_config, "get") else model_config.local_path
        path = local or model_config.path
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()
        generation = self.model.generation_config
        eos = generation.eos_token_id if generation.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.seed = int(getattr(config, "seed", 0))
        self.generator = torch.Generator().manual_seed(self.seed + replica_rank)
        self.deterministic = bool(getattr(config, "full_determinism", False))
        self.stop_rule = load_stop_rule(config)
        self.routing = None
        if bool(getattr(config, "enable_rollout_routing_replay", False)):
            from respo_verl.routing.hf import RoutingReplay

            try:
                self.routing = RoutingReplay(self.model, diagnostics=False)
            except ValueError as error:
                raise ValueError(
                    f"actor_rollout_ref.rollout.enable_rollout_routing_replay=true (routing=r3) needs an MoE model; "
                    f"{path}: {error}"
                ) from error
        # One request at a time: the model is small and CPU threads are better spent inside one forward.
        self._lock = asyncio.Lock()
        self._aborted = False

    def get_server_address(self) -> tuple[str, int]:
        return f"{ROLLOUT_NAME}-{self.replica_rank}", self.node_rank

    def _forward(self, input_ids: torch.Tensor, past, routes: list[torch.Tensor]):
        """One forward with the KV cache; with R3 on, appends the (tokens, layers, top-k) routes it chose."""
        if self.routing is None:
            return self.model(input_ids=input_ids, past_key_values=past, use_cache=True)
        with self.routing.record() as chosen:
            out = self.model(input_ids=input_ids, past_key_values=past, use_cache=True)
        routes.append(torch.stack([chosen[layer] for layer in self.routing.layers], dim=1))  # (tokens, L, K)
        return out

    @torch.no_grad()
    def _generate(
        self, prompt_ids: list[int], max_tokens: int, params: dict, generator: torch.Generator
    ) -> tuple[list[int], list[float], str, torch.Tensor | None]:
        temperature = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1) or -1)
        ignore_eos = bool(params.get("ignore_eos", False))
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)  # (1, P)
        past = None
        tokens, log_probs, routes = [], [], []
        for _ in range(max_tokens):
            out = self._forward(input_ids, past, routes)
            past = out.past_key_values
            token, log_prob = _sample(out.logits[0, -1], temperature, top_p, top_k, generator)
            tokens.append(token)
            log_probs.append(log_prob)
            if token in self.eos_token_ids and not ignore_eos:
                break
            if self.stop_rule is not None and self.stop_rule(len(tokens) - 1, token):
                break
            input_ids = torch.tensor([[token]], dtype=torch.long)  # (1, 1)
        # (P + len(tokens) - 1, L, K): the last sampled token was never fed to the model.
        routed = torch.cat(routes).to(torch.int16) if routes else None
        return tokens, log_probs, "completed", routed

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, image_data=None, **kwargs
    ):
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or kwargs.get("video_data") is not None:
            raise ValueError("the hf_cpu rollout takes token ids only (no images or videos)")
        params = dict(sampling_params)
        max_model_len = int(self.config.prompt_length + self.config.response_length)
        room = max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room within {max_model_len} tokens")
        requested = params.pop("max_tokens", params.pop("max_new_tokens", self.config.response_length))
        max_tokens = max(1, min(int(requested), int(self.config.response_length), room))
        async with self._lock:
            if self._aborted:
                return TokenOutput(
                    token_ids=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps}
                )
            if self.deterministic:
                generator = request_generator(self.seed, self.global_steps, request_id)
            else:
                generator = self.generator
            tokens, log_probs, stop, routed = await asyncio.to_thread(
                self._generate, list(prompt_ids), max_tokens, params, generator
            )
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs if params.get("logprobs") else None,
            routed_experts=None if routed is None else routed.numpy(),
            stop_reason=stop,
            extra_fields={"global_steps": self.global_steps},
        )

    def update_weights(self, state: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Load the trainer's full tensors; every model parameter must be present with its shape. Returns the count."""
        own = dict(self.model.named_parameters())
        unknown = sorted(set(state) - set(own))
        missing = sorted(set(own) - set(state))
        if unknown or missing:
            raise ValueError(
                f"hf_cpu rollout weight update does not match the model: unknown {unknown[:5]}, missing {missing[:5]}"
            )
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"hf_cpu rollout weight {name}: shape {tuple(tensor.shape)} != {tuple(own[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor)
        self.weight_updates += 1
        if global_steps is not None:
            self.global_steps = global_steps
        return len(state)

    # Control methods of verl's server interface. Weights and the KV cache live in host memory for the duration of a
    # request, so there is nothing to release or restore.
    async def wake_up(self, tags: list[str] | None = None):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def wait_for_requests_to_drain(self):
        async with self._lock:
            return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        self._aborted = True
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self):
        self._aborted = False

    async def resume_engine_generation(self):
        self._aborted = False

    async def open_submission_gate(self):
        self._aborted = False

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None


def _replica_class() -> type:
    from verl.workers.rollout.replica import RolloutReplica

    class CPURolloutReplica(RolloutReplica):
        """One :class:`CPURolloutServer` per replica, started next to the replica's first worker."""

        async def launch_servers(self):
            if self.world_size != 1 or self.nnodes != 1:
                raise ValueError(
                    "the hf_cpu rollout serves one process per replica: set actor_rollout_ref.rollout."
                    "tensor_model_parallel_size, data_parallel_size and pipeline_model_parallel_size to 1"
                )
            node_id = None
            if self.workers:
                node_id = await ray_private.call(self.workers[0], lambda _: ray.get_runtime_context().get_node_id())
            options = {"name": _server_name(self.replica_rank), "max_concurrency": self.max_concurrency, "num_cpus": 0}
            if node_id is not None:
                options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                )
            server = (
                ray.remote(CPURolloutServer)
                .options(**options)
                .remote(
                    config=self.config,
                    model_config=self.model_config,
                    rollout_mode=self.rollout_mode,
                    replica_rank=self.replica_rank,
                    node_rank=0,
                )
            )
            address, port = await server.get_server_address.remote()
            self.servers = [server]
            self._server_handle = server
            self._server_address = f"{address}:{port}"

    return CPURolloutReplica


def _adapter_class() -> type:
    from verl.workers.rollout.base import BaseRollout

    class CPURolloutAdapter(BaseRollout):
        """The rollout as seen from an actor worker: forwards weight updates to the replica's server."""

        def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **_):
            super().__init__(config, model_config, device_mesh)
            rank = int(os.environ.get("RANK", 0))
            self.replica_rank = rank if replica_rank == -1 else replica_rank  # one process per replica
            self.is_leader_rank = True
            self.sleep_level = 0
            self._server = None

        def _server_handle(self):
            if self._server is None:
                self._server = ray.get_actor(_server_name(self.replica_rank))
            return self._server

        async def resume(self, tags: list[str]):
            return None

        async def release(self):
            return None

        async def update_weights(self, weights: Iterable, global_steps: int | None = None, **kwargs):
            """Send the trainer's full tensors (HF names) to the server; every rank must drain ``weights``."""
            wire_format = kwargs.get("wire_format", "named_tensors")
            if wire_format != "named_tensors":
                raise ValueError(f"the hf_cpu rollout takes full named tensors, not {wire_format!r}")
            if kwargs.get("peft_config") is not None:
                raise ValueError("the hf_cpu rollout does not serve LoRA adapters; merge them (model.lora.merge=true)")
            started = time.perf_counter()
            state = {}
            async for name, tensor in _as_async(weights):
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                state[name] = full.detach().to("cpu", torch.float32).clone()
            state = dict(fuse_expert_weights(state.items()))
            await self._server_handle().update_weights.remote(state, global_steps)
            logger.debug("hf_cpu rollout: %d tensors synced in %.2fs", len(state), time.perf_counter() - started)

        def generate_sequences(self, prompts):
            raise NotImplementedError("the hf_cpu rollout serves verl's agent loop only (server mode)")

    return CPURolloutAdapter


async def _as_async(items):
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


def replica_class() -> type:
    """The ``hf_cpu`` rollout replica (one class per process, built on first use: it subclasses verl's)."""
    global _REPLICA
    if _REPLICA is None:
        _REPLICA = _replica_class()
    return _REPLICA


def adapter_class() -> type:
    """The ``hf_cpu`` rollout adapter of the actor workers (one class per process, built on first use)."""
    global _ADAPTER
    if _ADAPTER is None:
        _ADAPTER = _adapter_class()
    return _ADAPTER


_REPLICA: type | None = None
_ADAPTER: type | None = None


def __getattr__(name: str):
    # verl finds the adapter by its dotted name (ADAPTER_FQN) and imports it from this module.
    if name == "CPURolloutAdapter":
        return adapter_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
