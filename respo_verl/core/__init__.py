"""The maths of ReSPO and VESPO on plain tensors: torch and the standard library only.

Importable with verl, megatron-core, ray and hydra absent (a test checks this in a clean subprocess).
"""

from respo_verl.core.advantages import GroupAdvantage, group_relative_advantage
from respo_verl.core.config import KernelBranch, ReSPOConfig, VESPOConfig
from respo_verl.core.diagnostics import diagnostic_keys, kernel_diagnostics
from respo_verl.core.kernels import respo_log_phi, respo_phi, sequence_log_weight, vespo_log_phi, vespo_phi
from respo_verl.core.losses import KernelTerms, kernel_loss_tok, raise_on_nonfinite, respo_terms, vespo_terms

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
