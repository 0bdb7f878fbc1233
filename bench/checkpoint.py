"""Checkpoint benchmark: fsdp-trainer's sharded saves written in the background against
the gathered save (`--sharded_checkpoints=0`: the lead gathers and writes the whole state
while every rank waits), and against no checkpoint at all, at world 2 and 4 under `full`.

Per save, from the lead's `Saved checkpoint ...` line: how long after its step the
checkpoint was complete, and how long training paused for it. Per run: wall time (the
training time lost to saves is the difference with the run without checkpoints) and the
largest per-rank peak RSS.

usage: python bench/checkpoint.py [--agent target/release/fsdp-agent]
                                  [--trainer target/release/fsdp-trainer] [--worlds 2,4]
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 23.6M parameters: 283 MB of state (parameters and both AdamW moments, fp32).
MODEL = ["--hidden_width", "512", "--num_layers", "8", "--num_heads", "8", "--num_key_value_heads", "4",
         "--intermediate_size", "1376", "--train_batch_size", "1", "--max_steps", "12", "--threads", "1",
         "--logging_freq", "4", "--sharding_strategy", "full"]


def one(agent, trainer, world, mode):
    ck = tempfile.mkdtemp(prefix="fsdp-bench-ck-")
    extra = [] if mode == "none" else ["--checkpoint_dir", ck, "--checkpoint_freq", "4",
                                       "--sharded_checkpoints=" + ("1" if mode == "sharded" else "0")]
    cmd = [agent, "--standalone", "--nproc-per-node", str(world), "--status-addr", "off", "--no-python",
           trainer] + MODEL + extra
    t = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t
    shutil.rmtree(ck, ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    saves = [(float(a), float(b)) for a, b in
             re.findall(r"complete ([0-9.]+) s after the step, training paused ([0-9.]+) s", out.stdout)]
    peak = max(float(p) for p in re.findall(r"peak RSS: ([0-9.]+) MiB", out.stdout))
    return wall, saves, peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", default=os.path.join(ROOT, "target/release/fsdp-agent"))
    ap.add_argument("--trainer", default=os.path.join(ROOT, "target/release/fsdp-trainer"))
    ap.add_argument("--worlds", default="2,4")
    a = ap.parse_args()
    print("| world | save | complete after its step (median of 3 saves) | training paused per save | run wall | lost to saves | peak RSS per rank (max) |")
    print("|---|---|---|---|---|---|---|")
    for world in map(int, a.worlds.split(",")):
        base, _, base_peak = one(a.agent, a.trainer, world, "none")
        print(f"| {world} | none | - | - | {base:.1f} s | - | {base_peak:.0f} MiB |", flush=True)
        for mode in ["gathered", "sharded"]:
            wall, saves, peak = one(a.agent, a.trainer, world, mode)
            done = statistics.median(s[0] for s in saves)
            paused = statistics.median(s[1] for s in saves)
            print(f"| {world} | {mode} | {done:.2f} s | {paused:.3f} s | {wall:.1f} s | {wall - base:.1f} s "
                  f"| {peak:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
