#!/usr/bin/env bash
# The demo: set-up, build, then fsdp-agent runs 2 fsdp-trainer workers on this machine.
# They meet through PyTorch's c10d (TCPStore + Gloo), train the Llama-style decoder on
# the built-in corpus, and checkpoint. Run it twice: the second run resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build --release -p fsdp-agent -p fsdp-trainer
CKPT=${FSDP_DEMO_CHECKPOINTS:-/tmp/fsdp-demo-checkpoints}
args=(--standalone --nproc-per-node 2 --no-python target/release/fsdp-trainer
      --max_steps 200 --logging_freq 20 --checkpoint_freq 50
      --checkpoint_dir "$CKPT" --resume_from_checkpoint "$CKPT")
echo
echo "\$ fsdp-agent ${args[*]}"
exec target/release/fsdp-agent "${args[@]}"
