#!/usr/bin/env bash
# The trainer's GPU path on a CUDA machine, in one short run: fsdp-trainer alone on the
# GPU in fp32 and bf16; under fsdp-agent with an NCCL process group (of one: NCCL refuses
# two ranks on one GPU) under `full` sharding, saving sharded checkpoints from GPU tensors
# and resuming from them; two workers on a one-GPU node refused with the fix; and the same
# model under plain PyTorch on the GPU and under fsdp-trainer on the CPU, for the speeds
# beside it. Not part of the tests (CI has no GPU).
#
#   scripts/gpu-check.sh TRAINER AGENT [LOG_DIR]
#
# TRAINER is a `--features cuda` build linked against the libtorch this machine's
# PyTorch holds (LD_LIBRARY_PATH is set from `python3 -c 'import torch'` here).
set -uo pipefail
trainer=$(realpath "$1") agent=$(realpath "$2") out=${3:-/tmp/gpu-check}
mkdir -p "$out"
lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model=(--hidden_width 1024 --num_layers 8 --num_heads 16 --num_key_value_heads 4
       --intermediate_size 2816 --max_context_width 512 --train_batch_size 8
       --logging_freq 10 --seed 7)
failed=0
step() { # NAME EXPECTED-RC COMMAND...: run it, keep its output, check its exit code
    local name=$1 want=$2; shift 2
    echo "== $name"
    local t0=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    grep -E "Device:|Model:|Batch [0-9]+ Loss|Validation|Loaded|Saved|error|peak RSS|NCCL" "$out/$name.log" | tail -14
    echo "-- $name: exit $rc (want $want), $((SECONDS - t0)) s"
    [ "$rc" = "$want" ] || failed=1
}
step alone-fp32 0 "$trainer" "${model[@]}" --max_steps 200
step alone-bf16 0 "$trainer" "${model[@]}" --max_steps 200 --bf16=1
step agent-nccl-full 0 "$agent" --standalone --nproc-per-node 1 --no-python "$trainer" \
    "${model[@]}" --backend nccl --sharding_strategy full --bf16=1 --max_steps 40 \
    --checkpoint_freq 20 --checkpoint_dir "$work/ck" --validation_freq 20 --validation_batches 2
step agent-nccl-resume 0 "$agent" --standalone --nproc-per-node 1 --no-python "$trainer" \
    "${model[@]}" --backend nccl --sharding_strategy full --bf16=1 --max_steps 60 \
    --checkpoint_freq 20 --checkpoint_dir "$work/ck" --resume_from_checkpoint "$work/ck"
step agent-gloo-on-gpu 0 "$agent" --standalone --nproc-per-node 1 --no-python "$trainer" \
    "${model[@]}" --backend gloo --sharding_strategy shard_grad_op --max_steps 20
step two-workers-one-gpu 2 "$agent" --standalone --nproc-per-node 2 --max-restarts 0 \
    --no-python "$trainer" "${model[@]}" --max_steps 5
grep -h "LOCAL_RANK is" "$out/two-workers-one-gpu.log" | head -2
here=$(dirname "$(realpath "$0")")/..
step pytorch-same-model 0 python3 "$here/trainer/baseline/train_baseline.py" --device cuda \
    "${model[@]}" --max_steps 200
step cpu-same-model 0 env CUDA_VISIBLE_DEVICES= "$trainer" "${model[@]}" --max_steps 10 --threads 16
grep -q "Loaded checkpoint" "$out/agent-nccl-resume.log" || { echo "resume did not load"; failed=1; }
grep -q "Device: cuda:0" "$out/alone-fp32.log" || { echo "not on the GPU"; failed=1; }
grep -q "collectives: nccl, world 1" "$out/agent-nccl-full.log" || { echo "no NCCL group"; failed=1; }
echo "gpu-check: $([ $failed = 0 ] && echo passed || echo FAILED)"
exit $failed
