"""Shared test set-up: an offline, CPU-only environment and Hydra composition helpers.

Composition goes through Hydra's compose API with the same primary configs as the two entry points:
verl's ``ppo_trainer`` (``python -m verl.trainer.main_ppo``, our presets reached through the search-path plugin as
``+algorithm=...``) and our ``respo_trainer`` (``python -m respo_verl.main_ppo``, ``algorithm=...``).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import pytest

from respo_verl.verl.compose import CPU_COMPOSE_OVERRIDES as _DATACLASS_OVERRIDES
from respo_verl.verl.compose import compose_job

# What verl's validate_config needs on top of the dataclass conversion's keys, without a GPU cluster: the
# log-prob micro-batch sizes of the rollout and the reference model.
CPU_COMPOSE_OVERRIDES = (
    *_DATACLASS_OVERRIDES,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
)


def compose(overrides: list[str] | tuple[str, ...] = (), entry: str = "respo"):
    """Compose the job config of ``entry`` (``respo`` = our main_ppo, ``verl`` = verl's main_ppo)."""
    return compose_job(entry, overrides)


def actor_config(model_engine: str = "dp", algorithm: str = "respo", overrides: tuple[str, ...] = ()):
    """verl's actor dataclass (FSDPActorConfig / McoreActorConfig) built from a composed config, as verl does."""
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose([f"algorithm={algorithm}", f"model_engine={model_engine}", *CPU_COMPOSE_OVERRIDES, *overrides])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


@pytest.fixture(autouse=True)
def _restore_transformer_engine_attention_env():
    """megatron-core sets ``NVTE_*_ATTN`` in ``os.environ`` when it builds a model; keep that inside the test.

    Left set, they reach the trainer subprocesses of later tests, whose local attention backend refuses them.
    """
    from respo_verl.cpu.preset import TE_ATTENTION_ENV

    saved = {name: os.environ.get(name) for name in TE_ATTENTION_ENV}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(params=["dp", "megatron"])
def model_engine(request) -> str:
    return request.param


# Property tests search a fixed sequence of examples, so that CI is reproducible; HYPOTHESIS_PROFILE=explore
# searches afresh with more examples.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, deadline=None)
_hypothesis_settings.register_profile("explore", max_examples=2000, deadline=None)
_hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip themselves where no CUDA device is present."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
