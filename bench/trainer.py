"""Trainer benchmark: fsdp-trainer against the same model in Python/PyTorch
(trainer/baseline/train_baseline.py, DDP over gloo), both launched by fsdp-agent with 2
ranks on CPU and one intra-op thread per rank; and peak RSS per rank of fsdp-trainer with
no_shard against shard_grad_op on a model big enough for the optimizer state to dominate.

usage: python bench/trainer.py [--runs 3] [--agent target/release/fsdp-agent]
                               [--trainer target/release/fsdp-trainer] [--tiny]
Prints one JSON object (the suite reads it) after human-readable lines.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = os.path.join(ROOT, "trainer/baseline/train_baseline.py")

SPEED_MODEL = ["--hidden_width", "256", "--num_layers", "4", "--num_heads", "8", "--num_key_value_heads", "4",
               "--intermediate_size", "688", "--max_context_width", "128", "--train_batch_size", "8"]
# ~91M parameters: the optimizer state (two moments) is 730 MiB unsharded, well above
# libtorch's own resident size, so sharding it shows.
MEMORY_MODEL = ["--hidden_width", "1024", "--num_layers", "8", "--num_heads", "16", "--num_key_value_heads", "8",
                "--intermediate_size", "2752", "--max_context_width", "64", "--train_batch_size", "1"]


def launch(agent, program, args, nproc=2):
    cmd = [agent, "--standalone", "--nproc-per-node", str(nproc), "--status-addr", "off", "--no-python"]
    cmd += program + args
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out.stdout


def speeds(text, skip):
    s = [float(m) for m in re.findall(r"Speed: ([0-9.]+) samples/sec", text)]
    return s[skip:]


def peaks(text):
    return [float(m) for m in re.findall(r"Rank \d+ peak RSS: ([0-9.]+) MiB", text)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--agent", default=os.path.join(ROOT, "target/release/fsdp-agent"))
    ap.add_argument("--trainer", default=os.path.join(ROOT, "target/release/fsdp-trainer"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--tiny", action="store_true", help="smoke-test sizes")
    a = ap.parse_args()
    steps = "12" if a.tiny else "40"
    common = ["--max_steps", steps, "--logging_freq", "2" if a.tiny else "5", "--threads", "1"]
    speed_model = [] if a.tiny else SPEED_MODEL
    result = {"speed": {}, "memory": {}}
    for name, program in [("fsdp-trainer", [a.trainer]), ("python", [a.python, BASELINE])]:
        medians = []
        for _ in range(a.runs):
            s = speeds(launch(a.agent, program, speed_model + common), skip=2)
            medians.append(statistics.median(s))
        result["speed"][name] = medians
        print(f"{name}: samples/s per run {['%.1f' % m for m in medians]}", file=sys.stderr)
    mem_model = [] if a.tiny else MEMORY_MODEL
    for strategy in ["no_shard", "shard_grad_op"]:
        text = launch(a.agent, [a.trainer], mem_model + ["--max_steps", "2", "--threads", "1",
                                                          "--sharding_strategy", strategy])
        p = peaks(text)
        model_line = next((l for l in text.splitlines() if "parameters" in l), "")
        result["memory"][strategy] = {"peak_rss_mib_per_rank": p, "model": model_line.split("]:", 1)[-1]}
        print(f"{strategy}: peak RSS per rank {p} MiB ({model_line.strip()})", file=sys.stderr)
    text = launch(a.agent, [a.python, BASELINE], mem_model + ["--max_steps", "2", "--threads", "1"])
    result["memory"]["python-ddp"] = {"peak_rss_mib_per_rank": peaks(text)}
    ft, py = statistics.median(result["speed"]["fsdp-trainer"]), statistics.median(result["speed"]["python"])
    result["speed_ratio"] = ft / py
    print(f"fsdp-trainer {ft:.1f} samples/s vs python {py:.1f}: {ft / py:.2f}x", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
