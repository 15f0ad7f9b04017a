"""verl glue: what registers ReSPO in verl, and nothing else.

- ``losses``: a policy loss per kernel of :data:`respo_verl.core.losses.KERNELS` in verl's registry;
- ``advantage``: the ``respo`` advantage estimator;
- ``config``: the ``PolicyLossConfig`` subclass carrying the kernel hyperparameters;
- ``plugin``: the ``verl.plugins`` entry point that registers all of the above, the route-drift engines and the
  run's trainer (:mod:`respo_verl.run.trainer`).

What happens to a run (composition, checks, the trainer, checkpoints) is in :mod:`respo_verl.run`.
"""
