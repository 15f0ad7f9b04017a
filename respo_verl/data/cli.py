"""``respo-verl prepare-data {dapo-math,eval-math} ...``: write the paper's training or evaluation sets as parquet.

The console script (:mod:`respo_verl.cli`) picks the module by the dataset's name and runs its ``main`` with the
arguments after it.
"""

# dataset -> (module with main(argv), one-line help)
DATASETS = {
    "dapo-math": ("respo_verl.data.dapo_math", "DAPO-Math-17k (processed) -> the training parquet"),
    "eval-math": ("respo_verl.data.eval_math", "AIME24, AIME25, AMC23 -> the evaluation parquet files"),
}
