#!/usr/bin/env bash
# One rdzv-bench run against a fresh etcd of its own on tmpfs (the figures in
# docs/bench/agents-scale.md): etcd is started on 127.0.0.1 (ETCD_PORTS), its proposals
# pending, its apply backlog (committed, not applied), renewals, grants, revocations, keys
# and CPU are sampled each second while the bench runs, and the etcd, the sampler and the
# data are gone when the script ends, by an error or a signal too. To compare two etcds,
# run it once with each (ETCD_BIN).
#
#   cargo build --release -p fsdp-tests --bin rdzv-bench
#   scripts/rdzv-etcd.sh --nodes 10000 --settle 1            # a formation
#   scripts/rdzv-etcd.sh --nodes 10000 --ceiling              # the floor
#   ETCD_BIN=/path/to/etcd-3.5 scripts/rdzv-etcd.sh ...       # another etcd, same run shape
#
# Environment: ETCD_BIN (default: etcd on PATH, Debian's 3.4), ETCD_PORTS (client,
# metrics and peer ports, default "23790 23791 23792"), BENCH (default:
# target/release/rdzv-bench), BENCH_TIMEOUT (seconds, default 120), SAMPLES (a file to
# keep the per-second samples in, the bench's own CPU among them), METHODS (set: print
# what etcd served by gRPC method), PPROF (set: etcd serves Go's profiles at
# http://127.0.0.1:<client port>/debug/pprof/, e.g. .../profile?seconds=8 for
# `go tool pprof -top`).
set -u
dir=
etcd_pid=
sampler_pid=
bench_pid=
# The sampler stops when its file is gone, not on a signal: a subshell that gets one
# before its own trap is set loses it (the harness then waited on it for ever).
stop_sampler() {
    rm -f "$dir/sampling"
    wait "$sampler_pid" 2>/dev/null
    sampler_pid=
}
cleanup() {
    [ -n "$bench_pid" ] && kill "$bench_pid" 2>/dev/null
    [ -n "$sampler_pid" ] && stop_sampler
    if [ -n "$etcd_pid" ]; then
        kill "$etcd_pid" 2>/dev/null
        # etcd ends on SIGTERM within a second or two; one that does not is killed.
        for _ in $(seq 100); do kill -0 "$etcd_pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$etcd_pid" 2>/dev/null && kill -KILL "$etcd_pid" 2>/dev/null
        wait "$etcd_pid" 2>/dev/null
    fi
    [ -n "$dir" ] && rm -rf "$dir"
}
trap cleanup EXIT
# A signal ends the script through its EXIT trap.
trap 'exit 130' INT
trap 'exit 143' TERM HUP

root=$(cd "$(dirname "$0")/.." && pwd)
etcd_bin=${ETCD_BIN:-etcd}
bench=${BENCH:-$root/target/release/rdzv-bench}
[ -x "$bench" ] || { echo "no $bench: cargo build --release -p fsdp-tests --bin rdzv-bench" >&2; exit 2; }
command -v "$etcd_bin" >/dev/null || { echo "no etcd at '$etcd_bin': apt-get install etcd-server, or set ETCD_BIN" >&2; exit 2; }
command -v curl >/dev/null || { echo "no curl (it reads etcd's health and metrics): apt-get install curl" >&2; exit 2; }
command -v pgrep >/dev/null || { echo "no pgrep (it finds the bench's process): apt-get install procps" >&2; exit 2; }
read -r client_port metrics_port peer_port extra <<<"${ETCD_PORTS:-23790 23791 23792}"
[[ "$client_port $metrics_port $peer_port" =~ ^[0-9]+\ [0-9]+\ [0-9]+$ && -z "$extra" ]] ||
    { echo "ETCD_PORTS='${ETCD_PORTS:-}': give three port numbers (client, metrics, peer)" >&2; exit 2; }
client=http://127.0.0.1:$client_port metrics=http://127.0.0.1:$metrics_port peer=http://127.0.0.1:$peer_port

dir=$(mktemp -d /dev/shm/rdzv-etcd-XXXX) || { echo "cannot make a directory under /dev/shm" >&2; exit 2; }
echo "dir=$dir"
# etcd reads ETCD_* variables as its flags: not this script's own.
env -u ETCD_BIN -u ETCD_PORTS "$etcd_bin" --data-dir "$dir/data" \
    --listen-client-urls "$client" --advertise-client-urls "$client" \
    --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
    --initial-cluster "default=$peer" --listen-metrics-urls "$metrics" \
    --log-level error --quota-backend-bytes 8589934592 ${PPROF:+--enable-pprof} >"$dir/etcd.log" 2>&1 &
etcd_pid=$!
echo "etcd_pid=$etcd_pid"
# Until our etcd answers: one that exited (a port taken) must not let another process
# on the metrics port pass for it.
for _ in $(seq 100); do
    kill -0 "$etcd_pid" 2>/dev/null || break
    curl -sf --max-time 1 "$metrics/health" >/dev/null && break
    sleep 0.1
done
if ! kill -0 "$etcd_pid" 2>/dev/null || ! curl -sf --max-time 1 "$metrics/health" >/dev/null; then
    echo "etcd did not start:" >&2
    cat "$dir/etcd.log" >&2
    exit 2
fi
echo "etcd: $("$etcd_bin" --version | head -1)"

cpu_of() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null; }
# Prometheus writes large counters as 1.2e+06: whole numbers in the samples.
metric() { awk -v m="$1" '$1 == m {printf "%.0f", $2}' "$dir/scrape"; }
# Requests etcd took so far, by method (unary calls, streams' messages): what the crowd
# asks of it from moment to moment.
served() {
    awk '/^grpc_server_(started|msg_received)_total/ {
        match($0, /grpc_method="[^"]*"/); m = substr($0, RSTART + 13, RLENGTH - 14)
        s = $0 ~ /bidi_stream/ && $0 ~ /^grpc_server_msg_received/
        u = $0 !~ /bidi_stream/ && $0 ~ /^grpc_server_started/
        if (s || u) printf "%s=%.0f ", m, $NF }' "$dir/scrape"
}
touch "$dir/sampling"
(
    # Stops by itself too if the script was killed without its trap.
    while [ -e "$dir/sampling" ] && kill -0 $$ 2>/dev/null; do
        curl -s --max-time 1 "$metrics/metrics" >"$dir/scrape"
        # Committed but not applied: the apply loop's backlog, what keep-alives wait on.
        committed=$(metric etcd_server_proposals_committed_total)
        applied=$(metric etcd_server_proposals_applied_total)
        # Empty when a scrape failed, not 0: a missed sample is no empty backlog.
        backlog=
        [ -n "$committed" ] && [ -n "$applied" ] && backlog=$((committed - applied))
        echo "t=$(date +%s.%N | cut -c1-14) pending=$(metric etcd_server_proposals_pending) backlog=$backlog" \
            "renewed=$(metric etcd_debugging_lease_renewed_total)" \
            "granted=$(metric etcd_debugging_lease_granted_total)" \
            "revoked=$(metric etcd_debugging_lease_revoked_total)" \
            "keys=$(metric etcd_debugging_mvcc_keys_total) etcd_cpu_ticks=$(cpu_of "$etcd_pid")" \
            "bench_cpu_ticks=$(cpu_of "$(cat "$dir/bench.pid" 2>/dev/null)")" \
            "$(served)"
        # A second, in tenths: the stop is seen within one.
        for _ in 1 2 3 4 5 6 7 8 9 10; do [ -e "$dir/sampling" ] && sleep 0.1; done
    done
) >"$dir/samples" 2>/dev/null &
sampler_pid=$!

# The most a sampled count (pending, backlog) was.
most() { sed -n "s/.* $1=\([0-9][0-9]*\).*/\1/p" "$dir/samples" | sort -n | tail -1 | grep . || echo none; }
cpu0=$(cpu_of "$etcd_pid")
# In the background, so that a signal to the script ends it (cleanup kills it).
# --foreground: in this script's process group, which a caller may kill whole.
timeout --foreground -k 10 "${BENCH_TIMEOUT:-120}" "$bench" --endpoint "$client" "$@" &
bench_pid=$!
# The bench itself, under timeout: the sampler reads its CPU too.
for _ in 1 2 3 4 5 6 7 8 9 10; do
    pgrep -P "$bench_pid" >"$dir/bench.pid" && break
    sleep 0.05
done
wait "$bench_pid"
rc=$?
bench_pid=
cpu1=$(cpu_of "$etcd_pid")
stop_sampler
if [ -z "$cpu0" ] || [ -z "$cpu1" ]; then
    echo "etcd_cpu_s=? (etcd exited during the run)" >&2
    [ "$rc" = 0 ] && rc=2
else
    echo "etcd_cpu_s=$(awk -v a="$cpu0" -v b="$cpu1" -v t="$(getconf CLK_TCK)" 'BEGIN {printf "%.2f", (b - a) / t}')" \
        "pending_max=$(most pending)" "backlog_max=$(most backlog)"
fi
# What etcd served, by gRPC method (the bench's teardown included): requests a node.
if [ -n "${METHODS:-}" ] && curl -s --max-time 2 "$metrics/metrics" >"$dir/scrape"; then
    awk '/^grpc_server_(started|msg_received)_total/ && /bidi_stream/ || /^grpc_server_started_total/ && !/bidi_stream/ {
        k = $0 ~ /^grpc_server_started/ ? "started" : "messages"
        match($0, /grpc_method="[^"]*"/); m = substr($0, RSTART + 13, RLENGTH - 14)
        match($0, /grpc_type="[^"]*"/); t = substr($0, RSTART + 11, RLENGTH - 12)
        if ($NF + 0 > 0) printf "method %s %s %s %.0f\n", m, t, k, $NF }' "$dir/scrape" | sort -k5 -nr
fi
if [ -n "${SAMPLES:-}" ]; then
    cp "$dir/samples" "$SAMPLES" || echo "could not keep the samples in $SAMPLES" >&2
fi
[ "$rc" = 124 ] && echo "rdzv-bench: no result in ${BENCH_TIMEOUT:-120} s" >&2
exit "$rc"
