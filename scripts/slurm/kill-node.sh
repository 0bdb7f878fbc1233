#!/usr/bin/env bash
# A node death on the test cluster: SIGKILL at once to every process of node $1 (n1, n2
# or n3), its slurmd, slurmstepd and the job's tasks. slurmctld marks it down after
# SlurmdTimeout (5 s here, about 16 s in practice); start.sh
# brings it back.
set -euo pipefail
source "$(dirname "$0")/common.sh"

case "${1:-}" in
  n1 | n2 | n3) ;;
  *) echo "usage: kill-node.sh n1|n2|n3" >&2; exit 2 ;;
esac
[ -f "$SLURM_DIR/$1.uts" ] || { echo "kill-node: no node $1 in $SLURM_DIR (start.sh first)" >&2; exit 1; }
slurm_kill_ns "$1"
