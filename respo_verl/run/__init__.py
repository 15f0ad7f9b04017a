"""A run's lifecycle, from the command line to its last checkpoint.

- before Ray: ``compose`` (the job as verl's or our entry point composes it), ``jobcheck`` (a composed job that
  would fail late), ``datacheck`` (the parquet files), ``requirements`` (what the job needs on every node),
  ``resolvers`` (the presets' run name and save frequency);
- once Ray is up: ``preflight`` (every node imports the package, sees its registrations and has what the job needs);
- while it trains: ``trainer`` (verl's trainer with the run guard, failed-sample counts, the stop on request and the
  liveness watch), ``checkpoint`` (fingerprints, resume plans, the stop request);
- when it ends: ``reaper`` (no Ray process outlives the driver);
- ``launch``: the entry point's steps, in order.

verl's entry point (``python -m respo_verl.main_ppo``) calls these; the glue that registers them with verl is
:mod:`respo_verl.verl`.
"""
