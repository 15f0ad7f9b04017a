#!/usr/bin/env bash
# Qwen3-30B-A3B-Base, Megatron actor + vLLM rollout, ReSPO or a baseline, on a preset cluster layout (docs/method.md, "Published protocol").
# One run on a running Ray cluster (docs/cluster-quickstart.md: Ray at step 6, this at step 7), from its head:
#   RAY_ADDRESS=auto RAY_AUTH_MODE=token ALGO=respo N=16 SEED=0 examples/run_qwen3_30b_a3b_megatron.sh
# Under Slurm, scripts/launch/slurm/respo_verl.sbatch starts Ray over the allocation and runs this script.
set -euo pipefail

# ---- knobs ---------------------------------------------------------------------------------------------------
ALGO=${ALGO:-respo}                                # respo | vespo | grpo | gspo
N=${N:-8}                                          # rollout reuse: train_batch_size = 32·N prompts
SEED=${SEED:-1}
PRESET=${PRESET:-qwen3_30b_a3b_h100_2x8}           # configs/cluster/<PRESET>.yaml
ROUTING=${ROUTING:-}                               # routing replay: off | r2 | r3 (Megatron only); empty: off, as in the paper's grid
MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3-30B-A3B-Base}
DATA_DIR=${DATA_DIR:-$HOME/data/respo_verl}        # from `respo-verl prepare-data` (quick start, step 3)
CKPT_DIR=${CKPT_DIR:-$HOME/checkpoints/respo_verl}
PROJECT=${PROJECT:-respo_verl}
EXPERIMENT=${EXPERIMENT:-}                         # empty: the preset's, <model folder>-<algo>-n<N>-s<seed>[-<routing>]
LOGGER=${LOGGER:-[console,wandb]}
PYTHON=${PYTHON:-}                                 # empty: the checkout's .venv-gpu, else .venv, else python3
PLAN=${PLAN:-1}                                    # 1: check the layout with `respo-verl plan` before starting
DRY_RUN=${DRY_RUN:-0}                              # 1: print the command and compose it with --cfg job only
# ---------------------------------------------------------------------------------------------------------------

TASK=dapo_math_overlong                            # DAPO verifier + overlong buffer 4096 of 8192 (the paper's)
SEED_KEY=actor_rollout_ref.actor.megatron.seed
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/launch/launch_common.sh"
