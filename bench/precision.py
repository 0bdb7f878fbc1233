"""Mixed precision (`--bf16=1`): fsdp-trainer under `full` and `no_shard`, and the same model
under PyTorch's FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32) (bench/fsdp2_baseline.py --bf16 1), each in fp32 and bf16: samples/s
and peak RSS per rank at world 2, launched by fsdp-agent --standalone. And how far bf16's
losses stray from fp32's over 100 steps of the trainer's default model under `full`.

usage: python bench/precision.py [--agent target/release/fsdp-agent]
                                 [--trainer target/release/fsdp-trainer] [--tiny] [--json FILE]
--tiny: the default model, a few steps, fsdp-trainer only (the smoke test's sizes).
Prints one JSON object on stdout, progress on stderr.
"""
import argparse
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from full_shard import FSDP2, launch, peaks, speeds  # noqa: E402

# 23.6M parameters (bench/checkpoint.py's), batch 8 × 256 tokens per rank: big enough for
# the matrix work to outweigh the casts.
MODEL = ["--hidden_width", "512", "--num_layers", "8", "--num_heads", "8", "--num_key_value_heads", "4",
         "--intermediate_size", "1376", "--train_batch_size", "8", "--max_context_width", "256"]
STEPS = 4  # speeds: the last three logged (the first step builds and allocates)
LOSS_STEPS = 100


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def losses(text):
    return [float(m) for m in re.findall(r"Batch \d+ Loss: ([0-9.]+)", text)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", default=os.path.join(os.path.dirname(HERE), "target/release/fsdp-agent"))
    ap.add_argument("--trainer", default=os.path.join(os.path.dirname(HERE), "target/release/fsdp-trainer"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    model = [] if a.tiny else MODEL
    common = ["--max_steps", str(STEPS), "--logging_freq", "1", "--threads", "1"]
    kinds = {"fsdp-trainer full": ([a.trainer], ["--sharding_strategy", "full"], "--bf16={}"),
             "fsdp-trainer no_shard": ([a.trainer], ["--sharding_strategy", "no_shard"], "--bf16={}"),
             "PyTorch FSDP2": ([a.python, FSDP2], [], "--bf16 {}")}
    if a.tiny:
        del kinds["PyTorch FSDP2"]  # it imports torch in every rank: the smoke test's time
    out = {"world": 2, "steps": STEPS, "runs": {},
           "model": "the trainer's default model" if a.tiny else "hidden 512, 8 layers, batch 8 × 256 tokens per rank"}
    for name, (program, extra, flag) in kinds.items():
        for bf16 in (0, 1):
            # PyTorch's Gloo sometimes aborts in destroy_process_group after its last step
            # ("terminate called without an active exception"): the speeds it logged stand.
            text = launch(a, program, model + common + extra + flag.format(bf16).split(), 2, check=False)
            s = speeds(text or "", skip=1)
            if not s:
                raise RuntimeError(f"{name} bf16={bf16}: no speeds logged:\n{(text or '')[-2000:]}")
            params = re.search(r"Model: (\d+) parameters", text)
            out["runs"][f"{name} {'bf16' if bf16 else 'fp32'}"] = {
                "samples_per_s": s, "peak_mib": max(peaks(text) or [0]) or None,
                "params": int(params.group(1)) if params else None}
            log(f"{name} bf16={bf16}: samples/s {s}, peak RSS per rank {peaks(text)} MiB")
    steps = 10 if a.tiny else LOSS_STEPS
    curves = []
    for bf16 in (0, 1):
        text = launch(a, [a.trainer], ["--max_steps", str(steps), "--logging_freq", "1", "--threads", "1",
                                       "--sharding_strategy", "full", f"--bf16={bf16}"], 2)
        curves.append(losses(text))
    fp32, bf16 = curves
    out["loss_steps"] = steps
    out["loss_max_rel_diff"] = max(abs(b - f) / f for f, b in zip(fp32, bf16))
    log(f"bf16 against fp32 over {steps} steps: losses within {out['loss_max_rel_diff'] * 100:.3f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
