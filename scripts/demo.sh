#!/usr/bin/env bash
# The demo (the README's one demo command): set-up, build, then an elastic job on this
# machine — a local etcd, three fsdp-agents as three "nodes" (--nnodes 2:3) each running
# fsdp-trainer on one shared checkpoint directory. Mid-training it kills a node, brings it
# back, deletes another and brings it back, narrating each re-form with its figures
# (scripts/demo/elastic.py). Everything it starts is stopped on the way out, also on Ctrl-C.
#
#   scripts/demo.sh                 the elastic demo (about two minutes after set-up)
#   scripts/demo.sh --standalone    one node, two workers; run it twice: the second resumes
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-elastic}
case "$mode" in
  elastic|--standalone) ;;
  *) echo "usage: scripts/demo.sh [--standalone]" >&2; exit 64 ;;
esac
scripts/setup.sh
source scripts/env.sh
cargo build --release -p fsdp-agent -p fsdp-trainer
if [ "$mode" = elastic ]; then
  exec python3 scripts/demo/elastic.py \
    --agent target/release/fsdp-agent --trainer target/release/fsdp-trainer
fi
CKPT=${FSDP_DEMO_CHECKPOINTS:-/tmp/fsdp-demo-checkpoints}
args=(--standalone --nproc-per-node 2 --no-python target/release/fsdp-trainer
      --max_steps 200 --logging_freq 20 --checkpoint_freq 50
      --checkpoint_dir "$CKPT" --resume_from_checkpoint "$CKPT")
echo
echo "\$ fsdp-agent ${args[*]}"
exec target/release/fsdp-agent "${args[@]}"
