#!/usr/bin/env bash
# A Slurm of two nodes on this host, for trying the Slurm template (docs/cluster.md, "Slurm on one host"): munge,
# slurmctld and two slurmd (n1 at 127.0.0.1, n2 at 127.0.0.2, one fake `gpu` GRES each), every file under DIR.
#   sudo scripts/dev/local_slurm.sh start /tmp/slurm   # prints the `export SLURM_CONF=...` for sbatch, srun, squeue
#   sudo scripts/dev/local_slurm.sh stop /tmp/slurm    # cancels its jobs, stops its daemons by their pids
# Needs root; installs Debian's slurmctld, slurmd, slurm-client and munge with apt-get when they are missing.
# The same cluster the tests start (scripts/dev/local_slurm.py).
set -euo pipefail
ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON=${PYTHON:-}
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$ROOT_DIR/.venv/bin/python" ]]; then PYTHON="$ROOT_DIR/.venv/bin/python"; else PYTHON=python3; fi
fi
exec "$PYTHON" "$ROOT_DIR/scripts/dev/local_slurm.py" "$@"
