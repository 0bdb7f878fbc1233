#!/usr/bin/env bash
# Runs every test: set-up, build, format and lint checks, then the whole suite (unit,
# integration, fault tests against real processes, real etcd and real PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

export FSDP_VENV=${FSDP_VENV:-$HOME/.cache/fsdp-agent/venv}
export FSDP_TEST_PYTHON="$FSDP_VENV/bin/python"
export LIBTORCH_USE_PYTORCH=1
export PATH="$FSDP_VENV/bin:$PATH"

cargo fmt --all -- --check
cargo build --workspace --all-targets
cargo clippy --workspace --all-targets -- -D warnings

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --profile ci "$@"
else
  cargo test --workspace "$@"
fi
