"""verl 0.9.1: R3's routes stay uint8 from vLLM to the router where the model has at most 256 experts.

vLLM returns each sample's routes as a uint8 array when the model has at most 256 experts (its capture buffer,
``routed_experts_capturer.py``), and verl's agent loop widens them to int16 when it puts the sample into the
TransferQueue (``verl/experimental/agent_loop/agent_loop.py:131``, ``AgentLoopOutput.as_dict``). From there the
trainer workers fetch them, and verl widens each layer to int64 on the device only where it indexes
(``verl/utils/megatron/router_replay_utils.py``, ``set_router_replay_data``: ``.to(torch.int64)`` per layer, after
``.to(device_name)``); packing (``preprocess_thd_engine``), R3's alignment and the CPU engine's padded layout keep
whatever integer dtype they are given. :data:`ROUTES_UINT8` keeps vLLM's uint8 at ``as_dict``: half the bytes in
the TransferQueue and on every fetch. Routes of any other dtype (uint16 above 256 experts) take verl's int16 path
unchanged.

verl 0.9.1's TransferQueue path (``trainer/ppo/v1/agent_loop_tq.py``, the V1 trainer's, which respo-verl runs) already
stores each sample at its own length, prompt + response, with one zero row where vLLM has no route (the last token);
the padded layout over ``prompt_length + response_length`` is the older ``AgentLoopWorker._agent_loop_postprocess``
(``agent_loop.py:783-809``), which it does not take (docs/routing-replay.md, "What R3 costs").

Applied by the route-drift registration (:data:`respo_verl.routing.engine.REGISTRATION`, every verl process through
the plugin); ``RESPO_VERL_ROUTES_INT16=1`` in a run's environment leaves verl's int16 (the "before" of the
measurement).
Delete when: verl's agent loop keeps the dtype of the rollout's routes.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from respo_verl.patches import Patch

AGENT_LOOP_MODULE = "verl.experimental.agent_loop.agent_loop"
SWITCH_OFF_ENV = "RESPO_VERL_ROUTES_INT16"


def aligned_routes(routes: np.ndarray | torch.Tensor, total_length: int) -> torch.Tensor:
    """One sample's routes (rows, layers, k) over its ``total_length`` tokens (prompt + response), in their own
    dtype: rows beyond the routes' (vLLM has none for the last token) are zero, rows beyond the sample dropped."""
    routes = routes.numpy() if isinstance(routes, torch.Tensor) else np.asarray(routes)  # Ray's arrays: read-only
    aligned = np.zeros((total_length, *routes.shape[1:]), dtype=routes.dtype)  # (T, L, K)
    rows = min(routes.shape[0], total_length)
    aligned[:rows] = routes[:rows]
    return torch.from_numpy(aligned)


def _is_uint8(routes) -> bool:
    return getattr(routes, "dtype", None) in (np.uint8, torch.uint8)


def _keep_uint8_routes(patch: Patch) -> None:
    def wrap() -> None:
        from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

        original = vars(AgentLoopOutput)["as_dict"]

        @functools.wraps(original)
        def as_dict(self):
            routes = self.routed_experts
            if not _is_uint8(routes):
                return original(self)
            output = original(self.model_copy(update={"routed_experts": None}))  # verl's fields, no routes
            output["routed_experts"] = aligned_routes(routes, output["prompts"].size(0) + output["responses"].size(0))
            return output

        patch.replace(AgentLoopOutput, "as_dict", as_dict, "verl widens vLLM's uint8 routes to int16")

    if os.environ.get(SWITCH_OFF_ENV) != "1":
        patch.after_import(AGENT_LOOP_MODULE, wrap, "keep the rollout's uint8 routes")


ROUTES_UINT8 = Patch("R3's routes stay uint8 from vLLM to the router", "verl", "0.9.1", _keep_uint8_routes)
