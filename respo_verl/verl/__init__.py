"""verl glue: the losses, the estimator, their config and the plugin that registers them; composing a job as
verl's or our entry point does, the checks of a composed job, the per-node preflight.

- ``losses``: the ``respo`` and ``vespo`` policy losses registered in verl's registry;
- ``advantage``: the ``respo`` advantage estimator;
- ``config``: the ``PolicyLossConfig`` subclass carrying the kernel hyperparameters;
- ``plugin``: the ``verl.plugins`` entry point that registers all of the above (and the route-drift engines);
- ``compose``, ``jobcheck``, ``preflight``: composition, checks before Ray, the per-node check after it;
- ``experiment``: verl's losses and advantages for training loops outside verl's trainer.
"""
