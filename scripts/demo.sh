#!/usr/bin/env bash
# The demo: set-up, build, then the agent runs 2 PyTorch workers on this machine that
# rendezvous through gloo and all-reduce (examples/allreduce.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
FSDP_VENV=${FSDP_VENV:-$HOME/.cache/fsdp-agent/venv}
cargo build --release -p fsdp-agent
echo
echo "\$ fsdp-agent --standalone --nproc-per-node 2 examples/allreduce.py"
PYTHON="$FSDP_VENV/bin/python" exec target/release/fsdp-agent --standalone --nproc-per-node 2 examples/allreduce.py
