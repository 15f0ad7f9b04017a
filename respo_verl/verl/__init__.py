"""verl glue: the only package of respo_verl that imports verl.

- ``losses``: the ``respo`` and ``vespo`` policy losses registered in verl's registry;
- ``advantage``: the ``respo`` advantage estimator;
- ``config``: the ``PolicyLossConfig`` subclass carrying the kernel hyperparameters;
- ``plugin``: the ``verl.plugins`` entry point that registers all of the above in every process;
- ``main_ppo``: our Hydra entry point (``python -m respo_verl.main_ppo``), with its YAML under ``config/``.
"""
