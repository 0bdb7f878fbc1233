#!/usr/bin/env bash
# Runs every test: set-up, build, format and lint checks, then the whole suite (unit,
# integration, fault tests against real processes, real etcd and real PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

source scripts/env.sh

cargo fmt --all -- --check
cargo build --workspace --all-targets
cargo clippy --workspace --all-targets -- -D warnings

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --profile ci "$@"
else
  cargo test --workspace "$@"
fi
