#!/usr/bin/env bash
# The chaos soak for long runs: four pods under random SIGKILL, SIGTERM and SIGSTOP for
# FSDP_CHAOS_SECS seconds (default 1800), then the invariants of tests/tests/chaos.rs.
# FSDP_CHAOS_SEED=<n> replays a run. The test command runs the same soak for one minute.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
export FSDP_CHAOS_SECS=${FSDP_CHAOS_SECS:-1800}
cargo build --workspace --all-targets
# nextest's slow-timeout would end a long soak: run the test binary directly.
cargo test -p fsdp-tests --test chaos -- --nocapture
