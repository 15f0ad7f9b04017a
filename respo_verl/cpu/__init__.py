"""verl on a CPU machine: the runtime (the ``cpu`` platform, the ``hf_cpu`` rollout, verl's FSDP and Megatron engines
for device ``cpu``), its switch for Ray processes (``activate``), the vLLM plugin for vLLM's CPU build
(``vllm_cpu``), the presets' checks and driver set-up (``preset``) and the tiny model kit (``kit/``). ``respo-verl
demo`` (:mod:`respo_verl.tools.demo`) runs on it.

Importing a module here changes nothing in verl, except ``activate``, which is the switch:
:func:`respo_verl.cpu.runtime.enable` changes verl, once per process.
"""

# verl's name of our rollout (actor_rollout_ref.rollout.name), which is also how a job is recognised as a CPU job.
ROLLOUT_NAME = "hf_cpu"
