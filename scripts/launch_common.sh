# Sourced by examples/run_*.sh after their knob block: builds the verl command line, checks the layout with
# `respo-verl plan`, then runs it (or, with DRY_RUN=1, prints it and composes it with `--cfg job`).
# Expects: ALGO N SEED PRESET ROUTING MODEL_PATH DATA_DIR TASK SEED_KEY PYTHON DRY_RUN PLAN EXPERIMENT PROJECT
# CKPT_DIR LOGGER, and "$@" (extra Hydra overrides).

case "$ALGO" in respo|vespo|grpo|gspo) ;; *) echo "ALGO must be respo, vespo, grpo or gspo (got '$ALGO')" >&2; exit 2;; esac
case "$N" in ''|*[!0-9]*) echo "N must be a positive integer (got '$N')" >&2; exit 2;; esac
# SPEC §5: 32 prompts per mini-batch, train_batch_size = 32·N, 1024 optimizer updates per run.
PROMPTS_PER_UPDATE=32
TOTAL_UPDATES=1024
if (( N < 1 || TOTAL_UPDATES % N )); then echo "N must divide $TOTAL_UPDATES (got $N)" >&2; exit 2; fi

OVERRIDES=(
  "+cluster=$PRESET"
  "+task=$TASK"
  "data.train_batch_size=$((PROMPTS_PER_UPDATE * N))"
  "data.train_files=$DATA_DIR/dapo_math_17k.parquet"
  "data.val_files=[$DATA_DIR/aime24.parquet,$DATA_DIR/aime25.parquet,$DATA_DIR/amc23.parquet]"
  "data.seed=$SEED"
  "actor_rollout_ref.model.path=$MODEL_PATH"
  "$SEED_KEY=$SEED"
  "actor_rollout_ref.rollout.seed=$SEED"
  "trainer.total_training_steps=$((TOTAL_UPDATES / N))"
  "trainer.project_name=$PROJECT"
  "trainer.experiment_name=$EXPERIMENT"
  "trainer.default_local_dir=$CKPT_DIR/$EXPERIMENT"
  "trainer.logger=$LOGGER"
)
if [[ -n "$ROUTING" ]]; then OVERRIDES+=("+routing=$ROUTING"); fi
OVERRIDES+=("$@")
CMD=("$PYTHON" -m respo_verl.main_ppo "algorithm=$ALGO" "${OVERRIDES[@]}")

if [[ "$PLAN" == 1 ]]; then
  PLAN_ARGS=(--algorithm "$ALGO")
  if [[ -f "$MODEL_PATH/config.json" ]]; then PLAN_ARGS+=(--model-config "$MODEL_PATH/config.json"); fi
  "$PYTHON" -m respo_verl.cli plan "$PRESET" "${PLAN_ARGS[@]}" "${OVERRIDES[@]:1}" || {
    echo "layout check failed (PLAN=0 skips it)" >&2; exit 1; }
fi

echo "command:"; printf ' %q' "${CMD[@]}"; echo
if [[ "$DRY_RUN" == 1 ]]; then
  exec "${CMD[@]}" --cfg job
fi
exec "${CMD[@]}"
