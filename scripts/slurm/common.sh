# Sourced by the scripts in scripts/slurm: where the test cluster lives and how to reach it.
#   FSDP_SLURM_DIR   its state (configuration, spool, logs, munge); removed on stop
#   FSDP_SLURM_PORT  slurmctld's port; the three slurmd listen on the next three
SLURM_DIR=${FSDP_SLURM_DIR:-${TMPDIR:-/tmp}/fsdp-slurm}
SLURM_PORT=${FSDP_SLURM_PORT:-16817}
SLURM_NODES=(n1 n2 n3)
SLURM_CTL=fsdp-ctl
export SLURM_CONF="$SLURM_DIR/slurm.conf"

# The pids of every process whose UTS namespace is the one recorded for `name` when it
# started (a "node" is one UTS + mount namespace: its slurmd, slurmstepd and tasks).
# The host name is checked too, in case the kernel reused a dead namespace's inode.
slurm_ns_pids() {
  local name=$1 ns pid
  [ -f "$SLURM_DIR/$name.uts" ] || return 0
  ns=$(cat "$SLURM_DIR/$name.uts")
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$(readlink "/proc/$pid/ns/uts" 2>/dev/null)" = "$ns" ] || continue
    [ "$(nsenter --target "$pid" --uts hostname 2>/dev/null)" = "$name" ] || continue
    echo "$pid"
  done
}

# SIGKILL to every process of a node at once, slurmd included: a node death.
slurm_kill_ns() {
  local pids
  pids=$(slurm_ns_pids "$1")
  [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
}
