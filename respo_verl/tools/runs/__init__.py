"""Runs of a comparison: the manifest that describes them, their logs, and the paper's statistics of those logs.

One home for what ``respo-verl sweep`` writes, the miniature writes and ``respo-verl report`` reads:

- :mod:`respo_verl.tools.runs.manifest`: one JSON record per run (algorithm, N, seed, log, what a log step counts).
- :mod:`respo_verl.tools.runs.logs`: verl's file-logger logs, one line per training step (verl) or per optimizer update
  (the miniature, which says so in every line through ``mini/optimizer_step``).
- :mod:`respo_verl.tools.runs.stats`: the score curve per optimizer update and its late / early / AUC statistics
  (late = mean over the last 128 optimizer updates, as in the ReSPO paper, arXiv 2609.35433).
- :mod:`respo_verl.tools.runs.options`: the command-line list syntax for N and seeds shared by ``sweep`` and ``mini``.

Nothing here imports verl, torch or Hydra.
"""
