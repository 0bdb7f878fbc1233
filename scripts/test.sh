#!/usr/bin/env bash
# Runs every test: set-up, build, format and lint checks, then the whole suite (unit,
# integration, fault tests against real processes, real etcd and real PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

source scripts/env.sh

# The rendezvous' simulator, its exhaustive explorer and the switches that put fixed bugs
# back for them to find are test-only, behind its `sim` feature (docs/simulation.md): the
# tests turn it on; the release binary never has it. Every build and test below has it,
# so that one build serves them all (the debug agent the integration tests run has it
# too, as cargo unifies features: nothing in it sets a switch, so each stays off; the
# wheel and binary of the install tests are built without it).
sim=(--features fsdp-rendezvous/sim)
# Nothing the agent depends on turns it on (a dependency that did would put the simulator
# and the switches into every build of the agent, the release one too).
if cargo tree -p fsdp-agent -e normal,build,features | grep 'fsdp-rendezvous feature "sim"'; then
  echo "test.sh: the agent's dependencies turn on the rendezvous' simulator (feature sim)" >&2
  exit 1
fi

cargo fmt --all -- --check
cargo build --workspace --all-targets "${sim[@]}"
cargo clippy --workspace --all-targets "${sim[@]}" -- -D warnings
# Without the feature too, as the agent is built: the switches as constants, no
# simulator, nothing left unused.
cargo clippy -p fsdp-rendezvous --all-targets -- -D warnings
# The code's own docs (the crate tours link private modules and items: they are documented
# too) have no broken link.
RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" \
    cargo doc --workspace --no-deps --document-private-items "${sim[@]}"

# The wheel and the plain binary that the install tests put into a fresh venv and a
# minimal root (tests/tests/install.rs, wheel.rs), made by the script that makes the
# release ones. A debug build by default: the same files and the same glibc needs, and
# no release compile (several minutes on two cores) in every test run;
# FSDP_DIST_PROFILE=release scripts/test.sh tests the release build itself.
export FSDP_DIST_DIR="$PWD/target/dist-test"
FSDP_DIST_PROFILE=${FSDP_DIST_PROFILE:-dev} scripts/dist.sh "$FSDP_DIST_DIR"

# What the tests leave in the temporary directory (the default log directories of the
# agents they start, as torchrun's /tmp/torchelastic_*, and anything a killed test could
# not remove) goes into one directory, removed when the run ends: CI runs on a machine
# whose /tmp outlives it.
# The Slurm tests' cluster stays at its fixed place: munged runs as the munge user (who
# cannot enter a root-only directory), and a cluster left by a killed test is found and
# stopped there by the next run.
export FSDP_SLURM_DIR=${FSDP_SLURM_DIR:-/tmp/fsdp-slurm}
TMPDIR=$(mktemp -d "${TMPDIR:-/tmp}/fsdp-test.XXXXXX")
chmod 1777 "$TMPDIR"
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --profile ci "${sim[@]}" "$@"
else
  cargo test --workspace "${sim[@]}" "$@"
fi
