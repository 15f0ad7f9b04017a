#!/usr/bin/env bash
# Start (or stop) the Ray cluster a multi-node run needs. Run `head` on one node, `worker HEAD_IP` on the others,
# then the example script on the head with RAY_ADDRESS=auto (verl's main_ppo then joins this cluster).
#   scripts/launch/ray_cluster.sh head                # prints the address workers join
#   scripts/launch/ray_cluster.sh worker 10.0.0.1
#   scripts/launch/ray_cluster.sh stop
# Knobs: RAY_PORT (6379), NUM_GPUS (8), DASHBOARD_PORT (8265), RAY_TMPDIR (/tmp/ray), DRY_RUN=1 prints only.
set -euo pipefail
RAY_PORT=${RAY_PORT:-6379}
NUM_GPUS=${NUM_GPUS:-8}
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray}
DRY_RUN=${DRY_RUN:-0}

run() { printf ' %q' "$@"; echo; if [[ "$DRY_RUN" != 1 ]]; then "$@"; fi; }

case "${1:-}" in
  head)
    # The package must be importable on every node: the presets make verl import respo_verl.verl.plugin there.
    run python3 -c "import respo_verl.verl.plugin"
    run ray start --head --port="$RAY_PORT" --num-gpus="$NUM_GPUS" --dashboard-host=0.0.0.0 \
      --dashboard-port="$DASHBOARD_PORT" --temp-dir="$RAY_TMPDIR"
    ;;
  worker)
    HEAD_IP=${2:?usage: $0 worker HEAD_IP}
    run python3 -c "import respo_verl.verl.plugin"
    run ray start --address="$HEAD_IP:$RAY_PORT" --num-gpus="$NUM_GPUS" --block
    ;;
  stop) run ray stop ;;
  *) echo "usage: $0 head | worker HEAD_IP | stop" >&2; exit 2 ;;
esac
