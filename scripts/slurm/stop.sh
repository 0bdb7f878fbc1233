#!/usr/bin/env bash
# Stops the cluster scripts/slurm/start.sh started, with every job on it, and removes its
# state directory. Idempotent: nothing running and no directory is success.
set -euo pipefail
source "$(dirname "$0")/common.sh"

[ -d "$SLURM_DIR" ] || exit 0
# Nodes first (their slurmd, slurmstepd and tasks), then the controller, then munge.
for name in "${SLURM_NODES[@]}" "$SLURM_CTL"; do
  slurm_kill_ns "$name"
done
if [ -s "$SLURM_DIR/munge/munged.pid" ]; then
  kill "$(cat "$SLURM_DIR/munge/munged.pid")" 2>/dev/null || true
fi
# Whatever is left of the namespaces' processes is gone before the directory is removed.
for _ in $(seq 50); do
  left=""
  for name in "${SLURM_NODES[@]}" "$SLURM_CTL"; do
    left+=$(slurm_ns_pids "$name")
  done
  [ -z "$left" ] && break
  sleep 0.1
done
rm -rf "$SLURM_DIR"
echo "slurm: stopped, $SLURM_DIR removed" >&2
