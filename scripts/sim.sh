#!/usr/bin/env bash
# The deterministic simulator of the rendezvous (docs/simulation.md): long campaigns with
# a progress bar and a summary line, one seed replayed with its trace, a failing seed
# shrunk to the fewest faults that still fail it.
#
#   scripts/sim.sh --seeds 10000 [--seed-start S] [--agents K] [--faults F] [--threads T]
#   scripts/sim.sh --seed S [--agents K] [--shrink]
#   scripts/sim.sh --seeds 10000 --switch old-departures   # put a fixed bug back
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# The simulator is behind the rendezvous' `sim` feature (the agent is built without it).
cargo build --quiet --release -p fsdp-rendezvous --features sim --example sim
exec target/release/examples/sim "$@"
