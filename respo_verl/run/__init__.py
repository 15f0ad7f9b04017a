"""A run's lifecycle, from the command line to its last checkpoint.

- before Ray: ``compose`` (the job as verl's or our entry point composes it), ``jobcheck`` (a composed job that
  would fail late), :mod:`respo_verl.data.check` (the parquet files), ``requirements`` (what the job needs on every
  node), ``resolvers`` (the presets' run name and save frequency);
- once Ray is up: ``preflight`` (every node imports the package, has what the job needs and sees the run's folders),
  ``nodes`` (where each role runs, a lost node);
- while it trains: ``trainer`` (its registration) and ``respo_trainer`` (verl's trainer with the guards, the phase
  record and the stop on request), ``hooks`` (its patches of verl's objects), ``guards``, ``liveness`` (the actors
  a step waits on), ``watchdog`` (the driver's bounds on each phase), and :mod:`respo_verl.checkpoint`
  (fingerprints, resume plans: a layer below, for the sweep and the planner too);
- when it ends: ``stops`` (one line and an exit status), ``reaper`` (no Ray process outlives the driver);
- ``launch``: the entry point's steps, in order.

verl's entry point (``python -m respo_verl.main_ppo``) calls these; the glue that registers them with verl is
:mod:`respo_verl.verl`.
"""
