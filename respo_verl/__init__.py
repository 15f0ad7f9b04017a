"""ReSPO (Reshaped Sequence Policy Optimization) for verl.

Importing this package is cheap: it never imports verl, megatron-core, ray or hydra. The pure maths lives in
``respo_verl.core``; the verl glue (registrations) in ``respo_verl.verl``; a run's lifecycle in ``respo_verl.run``.
"""

__version__ = "0.1.0"
