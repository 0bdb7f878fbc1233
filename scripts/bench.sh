#!/usr/bin/env bash
# Every benchmark against torchrun in one run (about 20 minutes on 2 cores); regenerates
# docs/benchmarks.md and docs/bench/*.svg. Not part of the tests (a smoke test runs the
# suite at tiny sizes). Extra arguments go to bench/suite.py (e.g. --tiny --out /tmp/r).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build --release -p fsdp-agent -p fsdp-trainer -p fsdp-tests --bins
exec "$FSDP_VENV/bin/python" bench/suite.py "$@"
