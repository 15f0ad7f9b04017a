#!/usr/bin/env bash
# Start (or stop) the Ray cluster a multi-node run needs. Run `head` on one node, `worker HEAD_IP` on the others,
# then the example script on the head with RAY_ADDRESS=auto (verl's main_ppo then joins this cluster).
#   scripts/launch/ray_cluster.sh head                # prints the address workers join
#   scripts/launch/ray_cluster.sh worker 10.0.0.1
#   NODE_IP=127.0.0.2 scripts/launch/ray_cluster.sh worker 127.0.0.1 --node-manager-port=6380  # a 2nd node, 1 host
#   scripts/launch/ray_cluster.sh token               # makes the cluster's token if there is none; prints its file
#   scripts/launch/ray_cluster.sh wait 10.0.0.1 2     # until 2 nodes are alive (RAY_WAIT s); prints their addresses
#   scripts/launch/ray_cluster.sh stop
# Ray's token auth is always on (RAY_AUTH_MODE=token; docs/cluster.md, "Security"): every node, job and client needs
# the same token, read from RAY_AUTH_TOKEN, else from the file RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token, which a
# shared home gives every node). `head` and `token` make that file, readable by its owner only, when it is missing;
# `worker` refuses to start without it. The dashboard (Ray's Jobs API, which runs any command it is sent) listens on
# DASHBOARD_HOST: 127.0.0.1 by default (reach it through an SSH tunnel), or the head's cluster address if you set it.
# Knobs: RAY_PORT (6379), NUM_GPUS (8), NUM_CPUS (Ray's count of this node's CPUs), NODE_IP (the address Ray picks),
# NODE_PORTS (empty: Ray's; a number p: this node's own ports p to p+5, for the node manager, object manager, dashboard
# agent (listen, gRPC), runtime-env agent and metrics export, as a second node on one host needs), DASHBOARD_HOST
# (127.0.0.1), DASHBOARD_PORT (8265), RAY_TMPDIR (/tmp/ray), RAY_AUTH_TOKEN_PATH (~/.ray/auth_token), RAY_WAIT (300),
# DRY_RUN=1 prints only (and makes no token). Further arguments of `head` and `worker` go to `ray start` unchanged
# (`--block` keeps `head` in the foreground, as `worker` always is; other ports:
# docs/cluster.md, "Two nodes on one host").
# verl asks 3 logical CPUs per GPU slot (one placement bundle each): `head` and `worker` refuse a node with fewer,
# where verl's placement would wait for ever. Ray's CPUs are logical: NUM_CPUS may exceed the cores.
set -euo pipefail
RAY_PORT=${RAY_PORT:-6379}
NUM_GPUS=${NUM_GPUS:-8}
NUM_CPUS=${NUM_CPUS:-}
NODE_IP=${NODE_IP:-}
NODE_PORTS=${NODE_PORTS:-}
RAY_WAIT=${RAY_WAIT:-300}
CPUS_PER_GPU=3  # verl's bundle: {"CPU": 3, "GPU": 1} per GPU slot (max_colocate_count)
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

# The node's own options: its CPUs (checked against its GPU slots) and its address.
node_options() {
  local cpus=${NUM_CPUS:-$(nproc)} what="NUM_CPUS=$NUM_CPUS"
  if [[ -z "$NUM_CPUS" ]]; then what="the node's $cpus CPUs (nproc; NUM_CPUS unset)"; fi
  [[ "$NUM_GPUS" =~ ^[0-9]+$ ]] || die "NUM_GPUS must be a whole number (got '$NUM_GPUS')"
  [[ "$cpus" =~ ^[0-9]+$ ]] || die "NUM_CPUS must be a whole number (got '$cpus')"
  (( cpus >= CPUS_PER_GPU * NUM_GPUS )) ||
    die "$what for NUM_GPUS=$NUM_GPUS: verl's placement asks $CPUS_PER_GPU logical" \
      "CPUs per GPU slot and would wait for ever; set NUM_CPUS to at least $((CPUS_PER_GPU * NUM_GPUS))" \
      "(logical CPUs: more than the cores is fine)"
  NODE_OPTIONS=(--num-gpus="$NUM_GPUS")
  if [[ -n "$NUM_CPUS" ]]; then NODE_OPTIONS+=(--num-cpus="$NUM_CPUS"); fi
  if [[ -n "$NODE_IP" ]]; then NODE_OPTIONS+=(--node-ip-address="$NODE_IP"); fi
  if [[ -n "$NODE_PORTS" ]]; then
    [[ "$NODE_PORTS" =~ ^[0-9]+$ ]] || die "NODE_PORTS must be a port number (got '$NODE_PORTS')"
    NODE_OPTIONS+=(--node-manager-port="$NODE_PORTS" --object-manager-port="$((NODE_PORTS + 1))"
      --dashboard-agent-listen-port="$((NODE_PORTS + 2))" --dashboard-agent-grpc-port="$((NODE_PORTS + 3))"
      --runtime-env-agent-port="$((NODE_PORTS + 4))" --metrics-export-port="$((NODE_PORTS + 5))")
  fi
}

# Wait until the head at $1 listens, then until $2 nodes are alive; print their addresses on one line.
wait_nodes() {
  local head=$1 count=$2 deadline=$((SECONDS + RAY_WAIT))
  [[ "$count" =~ ^[1-9][0-9]*$ ]] || die "wait: the node count must be a positive number (got '$count')"
  # A driver that connects before the head listens waits for minutes: first wait for the port.
  until (exec 3<>"/dev/tcp/$head/$RAY_PORT") 2>/dev/null; do
    (( SECONDS < deadline )) || die "wait: nothing listens at $head:$RAY_PORT after $RAY_WAIT s"
    sleep 1
  done
  python3 - "$head:$RAY_PORT" "$count" "$((deadline - SECONDS))" <<'EOF'
import sys
import time

import ray

address, count, bound = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + bound
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
while True:
    alive = sorted(node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"])
    if len(alive) >= count:
        print(" ".join(alive))
        sys.exit(0)
    if time.monotonic() > deadline:
        sys.exit(f"ray_cluster.sh: wait: {len(alive)} of {count} Ray nodes alive at {address} after {bound:.0f} s")
    time.sleep(1)
EOF
}

case "${1:-}" in
  token)
    ensure_token
    echo "$RAY_AUTH_TOKEN_PATH"
    ;;
  head)
    node_options
    ensure_token
    # The package must be importable on every node: the presets make verl import respo_verl.verl.plugin there.
    run python3 -c "import respo_verl.verl.plugin"
    run ray start --head --port="$RAY_PORT" "${NODE_OPTIONS[@]}" --dashboard-host="$DASHBOARD_HOST" \
      --dashboard-port="$DASHBOARD_PORT" --temp-dir="$RAY_TMPDIR" "${@:2}"
    ;;
  worker)
    HEAD_IP=${2:?usage: $0 worker HEAD_IP [ray start options]}
    node_options
    if [[ "$DRY_RUN" != 1 ]]; then check_token; fi
    run python3 -c "import respo_verl.verl.plugin"
    run ray start --address="$HEAD_IP:$RAY_PORT" "${NODE_OPTIONS[@]}" --block "${@:3}"
    ;;
  wait)
    check_token
    wait_nodes "${2:?usage: $0 wait HEAD_IP NODE_COUNT}" "${3:?usage: $0 wait HEAD_IP NODE_COUNT}"
    ;;
  stop) run ray stop ;;
  *)
    echo "usage: $0 head [ray start options] | worker HEAD_IP [ray start options] | wait HEAD_IP NODE_COUNT |" \
      "token | stop" >&2
    exit 2
    ;;
esac
