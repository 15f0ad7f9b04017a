"""The paper's run protocol as numbers (arXiv 2609.35433; docs/method.md): one home for the sweep, the report, the
launch scripts (``scripts/launch/launch_common.sh`` reads them with ``python -c``) and the presets' tests.

Imports nothing.
"""

PAPER_REUSE = (8, 16, 32)  # N, optimizer updates per rollout batch
PAPER_SEEDS = (0, 1, 2)
PAPER_MINI_BATCH = 32  # prompts per optimizer update (ppo_mini_batch_size); train_batch_size = 32·N
PAPER_OPTIMIZER_STEPS = 1024  # updates per run: 1024 / N training steps
PAPER_LATE_WINDOW = 128  # the late score is the mean training score over the last 128 updates
