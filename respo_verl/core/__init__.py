"""The maths of ReSPO and VESPO on plain tensors: torch and the standard library only.

Importable with verl, megatron-core, ray and hydra absent (a test checks this in a clean subprocess).
"""

from __future__ import annotations

import importlib

# name -> defining module. Attributes are imported on first use (PEP 562), so that `respo_verl.core.config`
# (stdlib only) can be imported without torch, e.g. by respo_verl.run.jobcheck before a job is printed or planned.
_EXPORTS = {
    "GroupAdvantage": "advantages",
    "group_relative_advantage": "advantages",
    "KernelBranch": "config",
    "ReSPOConfig": "config",
    "VESPOConfig": "config",
    "diagnostic_keys": "diagnostics",
    "kernel_diagnostics": "diagnostics",
    "respo_log_phi": "kernels",
    "respo_phi": "kernels",
    "sequence_log_weight": "kernels",
    "vespo_log_phi": "kernels",
    "vespo_phi": "kernels",
    "KernelTerms": "losses",
    "kernel_loss_tok": "losses",
    "raise_on_nonfinite": "losses",
    "respo_terms": "losses",
    "vespo_terms": "losses",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "GroupAdvantage",
    "KernelBranch",
    "KernelTerms",
    "ReSPOConfig",
    "VESPOConfig",
    "diagnostic_keys",
    "group_relative_advantage",
    "kernel_diagnostics",
    "kernel_loss_tok",
    "raise_on_nonfinite",
    "respo_log_phi",
    "respo_phi",
    "respo_terms",
    "sequence_log_weight",
    "vespo_log_phi",
    "vespo_phi",
    "vespo_terms",
]
