"""Negative control for the CPU end-to-end test: the hf_cpu rollout never receives the trainer's new weights.

Loaded in every Ray process of one test run through ``VERL_USE_EXTERNAL_MODULES`` (after the CPU runtime's switch).
It points verl's rollout-class table at an adapter that drains the weights the trainer hands it and sends none to
the server, which keeps sampling from its initial weights: the rollout/actor log-prob gap must then grow.
"""

from verl.workers.rollout import base

from respo_verl.cpu.rollout import ROLLOUT_MODE, ROLLOUT_NAME, adapter_class


class FrozenRolloutAdapter(adapter_class()):
    async def update_weights(self, weights, global_steps=None, **kwargs):
        """Drain the weights (every rank must), tell the server the step (verl tags samples with it), send none."""
        if hasattr(weights, "__aiter__"):
            async for _ in weights:
                pass
        else:
            for _ in weights:
                pass
        if global_steps is not None:
            await self._server_handle().set_global_steps.remote(global_steps)


base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, ROLLOUT_MODE)] = f"{__name__}.FrozenRolloutAdapter"
