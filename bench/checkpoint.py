"""Checkpoint benchmark: fsdp-trainer's sharded saves written in the background against
the gathered save (`--sharded_checkpoints=0`: the lead gathers and writes the whole state
while every rank waits), and against no checkpoint at all, at world 2 and 4 under `full`.

Per save, from the lead's `Saved checkpoint ...` line: how long after its step the
checkpoint was complete, and how long training paused for it. Per run: wall time (the
training time lost to saves is the difference with the run without checkpoints) and the
largest per-rank peak RSS.

usage: python bench/checkpoint.py [--agent target/release/fsdp-agent]
                                  [--trainer target/release/fsdp-trainer] [--worlds 2,4]
                                  [--tiny] [--json FILE]
--tiny trains the trainer's default model (smoke-test sizes); --json also writes the
figures there (bench/suite.py reads them).
"""
import argparse
import json
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
         "--intermediate_size", "1376"]
RUN = ["--train_batch_size", "1", "--max_steps", "12", "--threads", "1", "--logging_freq", "4",
       "--sharding_strategy", "full"]
EVERY = 4  # a save every 4 steps: three in 12


def one(agent, trainer, world, mode, model):
    ck = tempfile.mkdtemp(prefix="fsdp-bench-ck-")
    extra = [] if mode == "none" else ["--checkpoint_dir", ck, "--checkpoint_freq", str(EVERY),
                                       "--sharded_checkpoints=" + ("1" if mode == "sharded" else "0")]
    cmd = [agent, "--standalone", "--nproc-per-node", str(world), "--status-addr", "off", "--no-python",
           trainer] + model + RUN + extra
    t = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t
    shutil.rmtree(ck, ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    # A sharded save says when it was complete and how long training paused; a gathered
    # one only the pause: it is complete when training goes on.
    saves = [(float(a or b), float(b)) for a, b in
             re.findall(r"Saved checkpoint .*?(?:complete ([0-9.]+) s after the step, )?training paused ([0-9.]+) s",
                        out.stdout)]
    peak = max(float(p) for p in re.findall(r"peak RSS: ([0-9.]+) MiB", out.stdout))
    params = int(re.search(r"Model: (\d+) parameters", out.stdout).group(1))
    return wall, saves, peak, params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", default=os.path.join(ROOT, "target/release/fsdp-agent"))
    ap.add_argument("--trainer", default=os.path.join(ROOT, "target/release/fsdp-trainer"))
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--tiny", action="store_true", help="the trainer's default model (smoke-test sizes)")
    ap.add_argument("--json", help="also write the figures here as JSON")
    a = ap.parse_args()
    model = [] if a.tiny else MODEL
    rows = []
    print("| world | save | complete after its step (median of 3 saves) | training paused per save | run wall | lost to saves | peak RSS per rank (max) |")
    print("|---|---|---|---|---|---|---|")
    for world in map(int, a.worlds.split(",")):
        base, _, base_peak, params = one(a.agent, a.trainer, world, "none", model)
        rows.append({"world": world, "save": "none", "wall_s": base, "peak_mib": base_peak})
        print(f"| {world} | none | - | - | {base:.1f} s | - | {base_peak:.0f} MiB |", flush=True)
        for mode in ["gathered", "sharded"]:
            wall, saves, peak, _ = one(a.agent, a.trainer, world, mode, model)
            done = statistics.median(s[0] for s in saves)
            paused = statistics.median(s[1] for s in saves)
            rows.append({"world": world, "save": mode, "wall_s": wall, "lost_s": wall - base, "peak_mib": peak,
                         "saves": len(saves), "complete_s": done, "paused_s": paused})
            print(f"| {world} | {mode} | {done:.2f} s | {paused:.3f} s | {wall:.1f} s | {wall - base:.1f} s "
                  f"| {peak:.0f} MiB |", flush=True)
    if a.json:
        steps = int(RUN[RUN.index("--max_steps") + 1])
        with open(a.json, "w") as f:
            json.dump({"params": params, "steps": steps, "every": EVERY, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
