"""ReSPO (Reshaped Sequence Policy Optimization) for verl.

Importing this package is cheap: it never imports verl, megatron-core, ray or hydra. The pure maths lives in
``respo_verl.core``; the verl glue in ``respo_verl.verl``.
"""

__version__ = "0.1.0"
