"""Layout planner: checks a cluster preset against the layout rules (:mod:`respo_verl.layout`) and estimates per-GPU
memory.

``respo-verl plan PRESET [overrides...]`` (see :mod:`respo_verl.tools.plan.cli`). Pure Python plus Hydra/omegaconf for
composing the preset exactly as the two entry points do; it imports neither torch nor verl.
"""
