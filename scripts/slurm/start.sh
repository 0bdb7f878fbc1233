#!/usr/bin/env bash
# Starts a real three-node Slurm cluster on this machine (Debian's slurmctld, slurmd and
# munge; scripts/setup.sh installs them), for the Slurm tests and for trying fsdp-agent
# under srun by hand:
#
#   eval "$(scripts/slurm/start.sh)"     # prints: export SLURM_CONF=...
#   srun -N3 fsdp-agent examples/allreduce.py
#   scripts/slurm/kill-node.sh n3        # a node death
#   scripts/slurm/start.sh               # n3 comes back
#   scripts/slurm/stop.sh
#
# Idempotent: a cluster whose controller answers is reused with its jobs, and a node that
# kill-node.sh killed is started again; anything else left in the state directory (a
# crashed run) is stopped and removed first.
#
# Each node n1..n3 is `slurmd -N nX` (Debian builds Slurm with MULTIPLE_SLURMD) in its own
# UTS and mount namespace: its own host name and a private /etc/hosts that names the
# three nodes, so jobs see three hosts. They share the network and PID namespace, so a
# node death is SIGKILL to every process in its namespace (kill-node.sh). No cgroups or
# systemd: proctrack/linuxproc, task/none, jobacct_gather/none.
set -euo pipefail
source "$(dirname "$0")/common.sh"

fail() {
  echo "slurm: $*" >&2
  for log in "$SLURM_DIR"/*.log; do
    [ -f "$log" ] && { echo "--- $log" >&2; tail -n 20 "$log" >&2; }
  done
  exit 1
}

for cmd in slurmctld slurmd srun scontrol sinfo munged mungekey unshare nsenter; do
  command -v "$cmd" >/dev/null 2>&1 \
    || fail "$cmd is missing: run scripts/setup.sh (apt: slurmctld slurmd slurm-client munge)"
done
[ "$(id -u)" -eq 0 ] || fail "needs root (namespaces and a bind-mounted /etc/hosts per node)"

# Every node registered and idle (or running a job): the cluster is usable.
cluster_up() {
  [ -f "$SLURM_CONF" ] || return 1
  local states
  states=$(timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
  [ "$(echo "$states" | grep -cE '^n[1-3] (idle|mixed|allocated|completing)$')" -eq 3 ]
}

# Whether the daemon of a pid file runs.
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# In its own UTS + mount namespace: host name $1 and the private /etc/hosts; the daemon
# forks into the background and keeps the namespaces alive.
in_namespace() {
  local name=$1
  shift
  unshare --uts --mount --propagation private sh -c \
    'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"' \
    "$name" "$SLURM_DIR/hosts" "$@"
}

# Records the daemon's UTS namespace: stop.sh and kill-node.sh find the node's processes
# by it, even once the daemon itself is dead.
record_namespace() {
  local name=$1 pidfile=$2
  for _ in $(seq 50); do
    alive "$pidfile" && break
    sleep 0.1
  done
  alive "$pidfile" || fail "$name wrote no pid file"
  readlink "/proc/$(cat "$pidfile")/ns/uts" >"$SLURM_DIR/$name.uts"
}

start_node() {
  rm -f "$SLURM_DIR/slurmd-$1.pid"
  in_namespace "$1" slurmd -f "$SLURM_CONF" -N "$1" || fail "slurmd -N $1 did not start"
  record_namespace "$1" "$SLURM_DIR/slurmd-$1.pid"
}

wait_up() {
  for _ in $(seq 300); do
    cluster_up && return 0
    sleep 0.1
  done
  fail "the nodes did not come up within 30 s: $(sinfo -h -N -o '%N %T' 2>&1 | tr '\n' ' ')"
}

# A live controller is kept with its jobs: a node killed by kill-node.sh comes back (and
# a requeued job waiting for it can run).
if alive "$SLURM_DIR/slurmctld.pid" && timeout 5 scontrol ping >/dev/null 2>&1; then
  for n in "${SLURM_NODES[@]}"; do
    alive "$SLURM_DIR/slurmd-$n.pid" || { echo "slurm: starting node $n again" >&2; start_node "$n"; }
  done
  wait_up
  echo "slurm: reusing the cluster in $SLURM_DIR" >&2
  echo "export SLURM_CONF=$SLURM_CONF"
  exit 0
fi
"$(dirname "$0")/stop.sh" >/dev/null 2>&1 || true

mkdir -p "$SLURM_DIR"
chmod 755 "$SLURM_DIR"

# munge: its own key, socket and files in the state directory, run as the munge user (it
# refuses root), so a system munged with another key is never involved.
MUNGE=$SLURM_DIR/munge
mkdir -p "$MUNGE"
mungekey --create --keyfile="$MUNGE/munge.key" --force 2>/dev/null \
  || dd if=/dev/urandom of="$MUNGE/munge.key" bs=1024 count=1 status=none
chown -R munge:munge "$MUNGE"
chmod 700 "$MUNGE"
chmod 600 "$MUNGE/munge.key"
runuser -u munge -- munged --socket="$MUNGE/munge.sock" --key-file="$MUNGE/munge.key" \
  --pid-file="$MUNGE/munged.pid" --log-file="$MUNGE/munged.log" \
  --seed-file="$MUNGE/munged.seed" --force \
  || fail "munged did not start ($(cat "$MUNGE/munged.log" 2>/dev/null | tail -n 3))"

# The nodes' private /etc/hosts: this machine's, plus the controller and the three nodes
# on the loopback address (they share this machine's network).
{
  grep -vE "[[:space:]](${SLURM_CTL}|n[1-3])([[:space:]]|$)" /etc/hosts || true
  echo "127.0.0.1 $SLURM_CTL ${SLURM_NODES[*]}"
} >"$SLURM_DIR/hosts"

node_lines=""
for i in "${!SLURM_NODES[@]}"; do
  n=${SLURM_NODES[$i]}
  mkdir -p "$SLURM_DIR/spool-$n"
  node_lines+="NodeName=$n NodeHostname=$n NodeAddr=127.0.0.1 Port=$((SLURM_PORT + 1 + i)) CPUs=2 State=UNKNOWN"$'\n'
done
mkdir -p "$SLURM_DIR/ctld"
cat >"$SLURM_CONF" <<EOF
# Written by scripts/slurm/start.sh; removed by stop.sh.
ClusterName=fsdp
SlurmctldHost=$SLURM_CTL(127.0.0.1)
SlurmctldPort=$SLURM_PORT
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (120 s by
# default): short, so that a requeue test takes seconds.
AuthInfo=socket=$MUNGE/munge.sock,cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$SLURM_DIR/ctld
SlurmdSpoolDir=$SLURM_DIR/spool-%n
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd-%n.pid
SlurmctldLogFile=$SLURM_DIR/slurmctld.log
SlurmdLogFile=$SLURM_DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
# A dead node is noticed in seconds, not Slurm's default five minutes, so that srun
# --no-kill goes on without it and srun's default kills the step promptly.
SlurmdTimeout=5
SlurmctldTimeout=5
MessageTimeout=5
KillWait=5
InactiveLimit=0
MinJobAge=300
$node_lines
PartitionName=debug Nodes=$(IFS=,; echo "${SLURM_NODES[*]}") Default=YES MaxTime=INFINITE State=UP
EOF

in_namespace "$SLURM_CTL" slurmctld -f "$SLURM_CONF" -i || fail "slurmctld did not start"
record_namespace "$SLURM_CTL" "$SLURM_DIR/slurmctld.pid"
for n in "${SLURM_NODES[@]}"; do
  start_node "$n"
done
wait_up
echo "slurm: cluster up in $SLURM_DIR (nodes ${SLURM_NODES[*]})" >&2
echo "export SLURM_CONF=$SLURM_CONF"
