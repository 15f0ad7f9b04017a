"""Test support: verl's router-replay patch of megatron-core, undone after a block (verl's own has no undo)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def verl_router_replay_patch() -> Iterator[None]:
    """verl's ``apply_router_replay_patch()`` for the duration of a block; megatron-core's classes are restored
    afterwards (verl's patch has no undo)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    saved = [(cls, dict(vars(cls))) for cls in (TopKRouter, TransformerConfig, MoEAlltoAllTokenDispatcher)]
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    apply_router_replay_patch()
    try:
        yield
    finally:
        for cls, attrs in saved:
            for name in set(vars(cls)) - set(attrs):
                delattr(cls, name)
            for name, value in attrs.items():
                if vars(cls).get(name) is not value:
                    setattr(cls, name, value)
