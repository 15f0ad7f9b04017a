#!/usr/bin/env bash
# Start (or stop) the Ray cluster a multi-node run needs. Run `head` on one node, `worker HEAD_IP` on the others,
# then the example script on the head with RAY_ADDRESS=auto (verl's main_ppo then joins this cluster).
#   scripts/launch/ray_cluster.sh head                # prints the address workers join
#   scripts/launch/ray_cluster.sh worker 10.0.0.1
#   scripts/launch/ray_cluster.sh token               # makes the cluster's token if there is none; prints its file
#   scripts/launch/ray_cluster.sh stop
# Ray's token auth is always on (RAY_AUTH_MODE=token; docs/cluster.md, "Security"): every node, job and client needs
# the same token, read from RAY_AUTH_TOKEN, else from the file RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token, which a
# shared home gives every node). `head` and `token` make that file, readable by its owner only, when it is missing;
# `worker` refuses to start without it. The dashboard (Ray's Jobs API, which runs any command it is sent) listens on
# DASHBOARD_HOST: 127.0.0.1 by default (reach it through an SSH tunnel), or the head's cluster address if you set it.
# Knobs: RAY_PORT (6379), NUM_GPUS (8), DASHBOARD_HOST (127.0.0.1), DASHBOARD_PORT (8265), RAY_TMPDIR (/tmp/ray),
# RAY_AUTH_TOKEN_PATH (~/.ray/auth_token), DRY_RUN=1 prints only (and makes no token).
set -euo pipefail
RAY_PORT=${RAY_PORT:-6379}
NUM_GPUS=${NUM_GPUS:-8}
DASHBOARD_HOST=${DASHBOARD_HOST:-127.0.0.1}
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray}
DRY_RUN=${DRY_RUN:-0}
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}

run() { printf ' %q' "$@"; echo; if [[ "$DRY_RUN" != 1 ]]; then "$@"; fi; }
die() { echo "ray_cluster.sh: $*" >&2; exit 2; }

# The token file must exist, hold a token and be readable by its owner only (anyone who reads it controls the cluster).
check_token() {
  if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then return; fi
  [[ -f "$RAY_AUTH_TOKEN_PATH" && -s "$RAY_AUTH_TOKEN_PATH" ]] ||
    die "no Ray token in $RAY_AUTH_TOKEN_PATH: run 'scripts/launch/ray_cluster.sh token' on the head, and give every" \
      "node the same file (a shared home does), or set RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN"
  local mode
  mode=$(stat -c %a "$RAY_AUTH_TOKEN_PATH")
  (( (8#$mode & 8#077) == 0 )) ||
    die "$RAY_AUTH_TOKEN_PATH is readable by others (mode $mode): chmod 600 it, or make a new token"
}

ensure_token() {
  if [[ -n "${RAY_AUTH_TOKEN:-}" || -e "$RAY_AUTH_TOKEN_PATH" ]]; then check_token; return; fi
  echo "ray_cluster.sh: making a Ray token in $RAY_AUTH_TOKEN_PATH (readable by you only)"
  if [[ "$DRY_RUN" == 1 ]]; then return; fi
  (
    umask 077
    mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
    # 256 random bits in hex, as Ray's own tokens
    printf '%s\n' "$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')" > "$RAY_AUTH_TOKEN_PATH.tmp.$$"
    mv -n "$RAY_AUTH_TOKEN_PATH.tmp.$$" "$RAY_AUTH_TOKEN_PATH" || true  # -n: a token made meanwhile wins
    rm -f "$RAY_AUTH_TOKEN_PATH.tmp.$$"
  )
  check_token
}

case "${1:-}" in
  token)
    ensure_token
    echo "$RAY_AUTH_TOKEN_PATH"
    ;;
  head)
    ensure_token
    # The package must be importable on every node: the presets make verl import respo_verl.verl.plugin there.
    run python3 -c "import respo_verl.verl.plugin"
    run ray start --head --port="$RAY_PORT" --num-gpus="$NUM_GPUS" --dashboard-host="$DASHBOARD_HOST" \
      --dashboard-port="$DASHBOARD_PORT" --temp-dir="$RAY_TMPDIR"
    ;;
  worker)
    HEAD_IP=${2:?usage: $0 worker HEAD_IP}
    if [[ "$DRY_RUN" != 1 ]]; then check_token; fi
    run python3 -c "import respo_verl.verl.plugin"
    run ray start --address="$HEAD_IP:$RAY_PORT" --num-gpus="$NUM_GPUS" --block
    ;;
  stop) run ray stop ;;
  *) echo "usage: $0 head | worker HEAD_IP | token | stop" >&2; exit 2 ;;
esac
