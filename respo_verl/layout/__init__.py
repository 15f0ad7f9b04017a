"""The parallel layout of a verl job and the rules megatron-core, vLLM and verl enforce on it at start-up.

:mod:`~respo_verl.layout.parallel` reads a :class:`~respo_verl.layout.parallel.Layout` from a composed job,
:mod:`~respo_verl.layout.models` the shape of its model (shipped facts or an HF ``config.json``), and
:mod:`~respo_verl.layout.rules` lists every rule the pair breaks. Plain Python and omegaconf, no torch, verl or
Hydra: the run applies the rules before Ray starts (:mod:`respo_verl.run.jobcheck`), ``respo-verl sweep`` before
its first run, and ``respo-verl plan`` next to its memory model.
"""
