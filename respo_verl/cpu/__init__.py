"""verl on a CPU machine: the runtime (platform, ``hf_cpu`` rollout, engines for device ``cpu``), the presets' checks,
the tiny model kit, and ``respo-verl demo``.

Nothing here changes verl on import; :func:`respo_verl.cpu.runtime.enable` does, once per process.
"""

# verl's name of our rollout (actor_rollout_ref.rollout.name), which is also how a job is recognised as a CPU job.
ROLLOUT_NAME = "hf_cpu"
