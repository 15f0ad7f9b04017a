# Sourced by examples/run_*.sh after their knob block: builds the verl command line, checks the layout with
# `respo-verl plan`, then runs it (or, with DRY_RUN=1, prints it and composes it with `--cfg job`).
# Expects: ALGO N SEED PRESET ROUTING MODEL_PATH DATA_DIR TASK SEED_KEY PYTHON DRY_RUN PLAN EXPERIMENT PROJECT
# CKPT_DIR LOGGER, and "$@" (extra Hydra overrides). An empty EXPERIMENT lets the preset name the run. An empty PYTHON
# means the checkout's GPU environment .venv-gpu if there is one (scripts/install_gpu_env.sh), else its .venv
# (`make setup`, CPU torch), else python3; it must import respo_verl, and for a CUDA job (trainer.device=cuda, verl's
# default) its torch must see CUDA.

ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$ROOT_DIR/.venv-gpu/bin/python" ]]; then PYTHON="$ROOT_DIR/.venv-gpu/bin/python"
  elif [[ -x "$ROOT_DIR/.venv/bin/python" ]]; then PYTHON="$ROOT_DIR/.venv/bin/python"
  else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import respo_verl" >/dev/null 2>&1; then
  echo "PYTHON=$PYTHON cannot import respo_verl: run 'make setup' in $ROOT_DIR (this script then uses its .venv)," \
    "or set PYTHON to the interpreter of the environment where respo-verl is installed" >&2
  exit 2
fi

# The algorithm presets, routing modes and the paper's protocol (prompts per mini-batch, optimizer updates per run),
# read from the package: respo_verl/algorithms.py, respo_verl/routing/mode.py, respo_verl/protocol.py.
read -r ALGOS ROUTINGS PROMPTS_PER_UPDATE TOTAL_UPDATES < <("$PYTHON" -c "
from respo_verl.algorithms import ALGORITHMS
from respo_verl.protocol import PAPER_MINI_BATCH, PAPER_OPTIMIZER_STEPS
from respo_verl.routing.mode import REPLAY_MODES
print(','.join(ALGORITHMS), ','.join(REPLAY_MODES), PAPER_MINI_BATCH, PAPER_OPTIMIZER_STEPS)")
choices() { local items="${1//,/, }"; echo "${items%, *} or ${items##*, }"; }  # a,b,c -> "a, b or c"
if [[ ",$ALGOS," != *",$ALGO,"* ]]; then echo "ALGO must be $(choices "$ALGOS") (got '$ALGO')" >&2; exit 2; fi
if [[ -n "$ROUTING" && ",$ROUTINGS," != *",$ROUTING,"* ]]; then
  echo "ROUTING must be $(choices "$ROUTINGS"), or empty (got '$ROUTING')" >&2; exit 2
fi
case "$N" in ''|*[!0-9]*) echo "N must be a positive integer (got '$N')" >&2; exit 2;; esac
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
  "trainer.default_local_dir=$CKPT_DIR/\${trainer.experiment_name}"
  "trainer.logger=$LOGGER"
)
# The run's name: the preset's (respo_verl/run/resolvers.py, run_name), unless EXPERIMENT replaces it.
if [[ -n "$EXPERIMENT" ]]; then OVERRIDES+=("trainer.experiment_name=$EXPERIMENT"); fi
# routing is a config group of respo_verl.main_ppo's primary config: a plain override, not +routing=.
if [[ -n "$ROUTING" ]]; then OVERRIDES+=("routing=$ROUTING"); fi
OVERRIDES+=("$@")
CMD=("$PYTHON" -m respo_verl.main_ppo "algorithm=$ALGO" "${OVERRIDES[@]}")

# The job's device, from the overrides (the cluster presets leave verl's default, cuda; the device=cpu and
# device=cpu_megatron presets set cpu). A CUDA job from an interpreter whose torch has no CUDA (the checkout's .venv
# after `make setup` has CPU torch) is refused here rather than deep in a Ray worker. A dry run only composes.
DEVICE=cuda
for override in "${OVERRIDES[@]}"; do
  case "$override" in
    trainer.device=*|+trainer.device=*|++trainer.device=*) DEVICE="${override#*trainer.device=}";;
    device=*|+device=*|++device=*) DEVICE=cpu;;
  esac
done
if [[ "$DEVICE" == cuda && "$DRY_RUN" != 1 ]]; then
  cuda_status=0
  found=$("$PYTHON" -c 'import sys
print(sys.executable, "Python", sys.version.split()[0], end="")
import torch
print(", torch", torch.__version__, end="")
sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null) || cuda_status=$?
  if (( cuda_status != 0 )); then
    echo "PYTHON=$PYTHON ($found) has no CUDA (torch.cuda.is_available() is not True) but this job runs with" \
      "trainer.device=cuda: install the GPU environment (scripts/install_gpu_env.sh creates $ROOT_DIR/.venv-gpu," \
      "which this script then prefers), or set PYTHON to an interpreter whose torch sees CUDA" >&2
    exit 2
  fi
fi

if [[ "$PLAN" == 1 ]]; then
  PLAN_ARGS=(--algorithm "$ALGO")
  if [[ -f "$MODEL_PATH/config.json" ]]; then PLAN_ARGS+=(--model-config "$MODEL_PATH/config.json"); fi
  status=0
  "$PYTHON" -m respo_verl.cli plan "$PRESET" "${PLAN_ARGS[@]}" "${OVERRIDES[@]:1}" || status=$?
  case "$status" in
    0) ;;
    1) echo "layout check failed: the rules listed above are violated (PLAN=0 starts without the check)" >&2; exit 1;;
    2) echo "respo-verl plan refused its input (the line above says why)" >&2; exit 2;;
    *) echo "respo-verl plan did not run (exit $status)" >&2; exit "$status";;
  esac
fi

echo "command:"; printf ' %q' "${CMD[@]}"; echo
if [[ "$DRY_RUN" == 1 ]]; then
  exec "${CMD[@]}" --cfg job
fi
exec "${CMD[@]}"
