#!/usr/bin/env bash
# One rdzv-bench run against a fresh etcd of its own on tmpfs (the figures in
# docs/bench/agents-scale.md): etcd is started on 127.0.0.1 (ETCD_PORTS),
# its proposals pending, renewals, grants, revocations, keys and CPU are sampled each
# second while the bench runs, and everything is removed afterwards. Another etcd's
# figures beside Debian's: a side-by-side run of each, one after the other.
#
#   cargo build --release -p fsdp-tests --bin rdzv-bench
#   scripts/rdzv-etcd.sh --nodes 10000 --settle 1            # a formation
#   scripts/rdzv-etcd.sh --nodes 10000 --ceiling              # the floor
#   ETCD_BIN=/path/to/etcd-3.5 scripts/rdzv-etcd.sh ...       # another etcd, same run shape
#
# Environment: ETCD_BIN (default: etcd on PATH, Debian's 3.4), ETCD_PORTS (client,
# metrics and peer ports, default "23790 23791 23792"), BENCH (default:
# target/release/rdzv-bench), BENCH_TIMEOUT (seconds, default 120), SAMPLES (a file to
# keep the per-second samples in; default: printed as a summary only).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
etcd_bin=${ETCD_BIN:-etcd}
bench=${BENCH:-$root/target/release/rdzv-bench}
[ -x "$bench" ] || { echo "no $bench: cargo build --release -p fsdp-tests --bin rdzv-bench" >&2; exit 2; }
command -v "$etcd_bin" >/dev/null || { echo "no etcd at '$etcd_bin': apt-get install etcd-server, or set ETCD_BIN" >&2; exit 2; }

read -r client_port metrics_port peer_port <<<"${ETCD_PORTS:-23790 23791 23792}"
[ -n "$peer_port" ] || { echo "ETCD_PORTS needs three ports: client, metrics, peer" >&2; exit 2; }
client=http://127.0.0.1:$client_port metrics=http://127.0.0.1:$metrics_port peer=http://127.0.0.1:$peer_port
dir=$(mktemp -d /dev/shm/rdzv-etcd-XXXX)
etcd_pid=
sampler_pid=
cleanup() {
    [ -n "$sampler_pid" ] && kill "$sampler_pid" 2>/dev/null
    [ -n "$etcd_pid" ] && kill "$etcd_pid" 2>/dev/null && wait "$etcd_pid" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT

"$etcd_bin" --data-dir "$dir/data" \
    --listen-client-urls "$client" --advertise-client-urls "$client" \
    --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
    --initial-cluster "default=$peer" --listen-metrics-urls "$metrics" \
    --log-level error --quota-backend-bytes 8589934592 >"$dir/etcd.log" 2>&1 &
etcd_pid=$!
for _ in $(seq 100); do
    curl -sf "$metrics/health" >/dev/null && break
    sleep 0.1
done
curl -sf "$metrics/health" >/dev/null || { echo "etcd did not start:" >&2; cat "$dir/etcd.log" >&2; exit 2; }
echo "etcd: $("$etcd_bin" --version | head -1)"

cpu_of() { awk '{print $14 + $15}' "/proc/$1/stat"; }
metric() { awk -v m="$1" '$1 == m {print $2}' "$dir/scrape"; }
(
    while :; do
        curl -s "$metrics/metrics" >"$dir/scrape"
        echo "t=$(date +%s.%N | cut -c1-14) pending=$(metric etcd_server_proposals_pending)" \
            "renewed=$(metric etcd_debugging_lease_renewed_total)" \
            "granted=$(metric etcd_debugging_lease_granted_total)" \
            "revoked=$(metric etcd_debugging_lease_revoked_total)" \
            "keys=$(metric etcd_debugging_mvcc_keys_total) etcd_cpu_ticks=$(cpu_of "$etcd_pid")"
        sleep 1
    done
) >"$dir/samples" 2>/dev/null &
sampler_pid=$!

cpu0=$(cpu_of "$etcd_pid")
timeout "${BENCH_TIMEOUT:-120}" "$bench" --endpoint "$client" "$@"
rc=$?
cpu1=$(cpu_of "$etcd_pid")
kill "$sampler_pid" 2>/dev/null
sampler_pid=
echo "etcd_cpu_s=$(( (cpu1 - cpu0) / $(getconf CLK_TCK) ))" \
    "pending_max=$(sed -n 's/.* pending=\([0-9]*\).*/\1/p' "$dir/samples" | sort -n | tail -1)"
[ -n "${SAMPLES:-}" ] && cp "$dir/samples" "$SAMPLES"
[ "$rc" = 124 ] && echo "rdzv-bench: no result in ${BENCH_TIMEOUT:-120} s" >&2
exit "$rc"
