"""What peer-memory snapshots cost a step: three fsdp-trainer ranks on Gloo (no agent: the
snapshots are taken because FSDP_AGENT_CONTROL is set), --max_steps steps with
--snapshot_freq 0 and 1, alternated --runs times. Prints the wall time of each run and the
trainer's own account ("Snapshots: N taken, X ms each, Y% of the time in steps").

usage: python bench/snapshot_cost.py [--trainer target/release/fsdp-trainer] [--steps 150] [--runs 2]
"""
import argparse
import os
import re
import socket
import subprocess
import tempfile
import time

MODEL = ["--hidden_width", "128", "--num_layers", "4", "--intermediate_size", "344", "--num_heads", "8",
         "--num_key_value_heads", "4", "--max_context_width", "64", "--threads", "1"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(trainer, steps, freq, workdir):
    port = free_port()
    procs = []
    began = time.monotonic()
    for r in range(3):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   FSDP_AGENT_CONTROL=os.path.join(workdir, f"ctl{r}"))
        procs.append(subprocess.Popen([trainer, *MODEL, "--max_steps", str(steps), "--logging_freq", str(steps),
                                       "--snapshot_freq", str(freq)], env=env, text=True,
                                      stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL))
    out = procs[0].communicate()[0]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: {codes}\n{out}")
    own = re.search(r"Snapshots: \d+ taken, .*", out)
    return time.monotonic() - began, own.group(0) if own else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainer", default="target/release/fsdp-trainer")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    walls = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="snapshot-cost-") as workdir:
        for _ in range(a.runs):
            for freq in (0, 1):
                wall, own = run(a.trainer, a.steps, freq, workdir)
                walls[freq].append(wall)
                print(f"--snapshot_freq {freq}: {wall:.2f} s for {a.steps} steps  {own}", flush=True)
    off, on = min(walls[0]), min(walls[1])
    print(f"best of {a.runs}: {off:.2f} s without, {on:.2f} s with snapshots: {100 * (on / off - 1):+.1f}% wall")


if __name__ == "__main__":
    main()
