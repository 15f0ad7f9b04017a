"""A tiny model kit for running verl's trainer on a CPU: model, tokenizer, data and reward, built offline.

``python -m respo_verl.cpu.kit`` builds it (or finds it cached) and prints its folder; ``respo_verl.main_ppo`` with
the ``+device=cpu`` preset builds it on demand. Nothing here imports verl: the kit is plain files that verl reads
(an HF model folder saved with ``save_pretrained``, a tokenizer built with ``tokenizers``, parquet files in verl's
RLHF format) plus :func:`respo_verl.cpu.kit.reward.compute_score`, which verl loads as a custom reward function.
"""
