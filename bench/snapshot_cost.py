"""What peer-memory snapshots cost a step: fsdp-trainer ranks on Gloo (no agent: the
snapshots are taken because FSDP_AGENT_CONTROL is set), --steps steps with --snapshot_freq 0
and 1, alternated --runs times, for each --ranks count.

The figure is the **step time**: the trainer logs its training speed every 10 steps (pauses
for saves and validation left out); a run's step time is the median of its windows after
the first (start-up and warm-up left out), and a configuration's is the median over its
runs. The wall time of whole runs is printed beside it but is not the figure: on a machine
with fewer cores than ranks it swings by 10% from run to run with the same flags, more than
the cost measured. The trainer's own account ("Snapshots: N taken, X ms each, Y% of the
time in steps": the time the step loop spends taking a snapshot and starting its copy) is
printed too. Two ranks on two cores is a rank per core, as on a real node; three ranks on
two cores share them, so the copy's work on Gloo's threads takes time from the steps.

The **floor**, measured in the same run: what moving the same bytes costs a step on this
machine with nothing of the trainer in it. Plain torch.distributed Gloo ranks run a compute
loop as long as the trainer's step, in blocks of 10 steps without and with copying a buffer
the size of a rank's part and sending it to the next rank (isend/irecv, overlapping the
next step, as the snapshots do). On a machine whose cores all train there is no idle core for the copy's
kernel and Gloo work, so no off-node copy can cost less than this; the snapshots' overhead
is given as a ratio to it.

usage: python bench/snapshot_cost.py [--trainer target/release/fsdp-trainer] [--steps 150] [--runs 3]
                                     [--ranks 2,3]
"""
import argparse
import os
import re
import socket
import statistics
import subprocess
import tempfile
import sys
import time

MODEL = ["--hidden_width", "128", "--num_layers", "4", "--intermediate_size", "344", "--num_heads", "8",
         "--num_key_value_heads", "4", "--max_context_width", "64", "--threads", "1"]
WINDOW = 10
BATCH = 8  # the trainer's --train_batch_size: the speed it logs counts every rank's samples


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(trainer, ranks, steps, freq, workdir):
    """One run: (wall s, step s, the trainer's own account of its snapshots)."""
    port = free_port()
    procs = []
    began = time.monotonic()
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   FSDP_AGENT_CONTROL=os.path.join(workdir, f"ctl{r}"))
        procs.append(subprocess.Popen([trainer, *MODEL, "--max_steps", str(steps), "--logging_freq", str(WINDOW),
                                       "--snapshot_freq", str(freq)], env=env, text=True,
                                      stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL))
    out = procs[0].communicate()[0]
    codes = [p.wait() for p in procs]
    wall = time.monotonic() - began
    if any(codes):
        raise SystemExit(f"a rank failed: {codes}\n{out}")
    speeds = [float(s) for s in re.findall(r"Speed: ([0-9.]+) samples/sec", out)]
    if len(speeds) < 3:
        raise SystemExit(f"too few log lines to time steps ({len(speeds)}):\n{out}")
    own = re.search(r"Snapshots: \d+ taken, .*", out)
    return wall, BATCH * ranks / statistics.median(speeds[1:]), own.group(0) if own else ""


def floor_worker(rank, world, port, nbytes, step_s, steps):
    """One rank of the floor: a compute loop of `step_s` a step, in blocks of 10 steps that
    alternate without and with a buffer of `nbytes` copied and sent to the next rank after
    each step, finished after the next step's gradient all-reduce (as the snapshots' copy
    is finished at the step's fence). Alternating blocks in one run compares the two on
    the same processes and the same minutes, which separate runs on this machine do not
    (their step times differ by 10%). Rank 0 prints the median step time of each kind,
    the first 10 steps left out."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    began = time.perf_counter()
    for _ in range(20):
        a @ b
    reps = torch.tensor([max(1, round(step_s / ((time.perf_counter() - began) / 20)))])
    dist.broadcast(reps, 0)
    n = nbytes // 4
    state, snap, inbox = torch.randn(n), torch.empty(n), torch.empty(n)
    grads, flags = torch.randn(200_000), torch.zeros(3)
    times, pending = {0: [], 1: []}, []
    for i in range(steps):
        move = (i // 10) % 2
        began = time.perf_counter()
        for _ in range(int(reps)):
            a @ b
        dist.all_reduce(grads)
        for p in pending:
            p.wait()
        state.add_(1e-6)
        pending = []
        if move:
            snap.copy_(state)
            pending = [dist.isend(snap, (rank + 1) % world), dist.irecv(inbox, (rank - 1) % world)]
        dist.all_reduce(flags)
        if i >= 10:
            times[move].append(time.perf_counter() - began)
    for p in pending:
        p.wait()
    if rank == 0:
        print(statistics.median(times[0]), statistics.median(times[1]), flush=True)
    dist.destroy_process_group()


def floor(ranks, nbytes, step_s, steps):
    """(step s without, with the move) from one run of alternating blocks."""
    port = free_port()
    cmd = [sys.executable, __file__, "--floor-worker"]
    procs = [subprocess.Popen(cmd + [str(r), str(ranks), str(port), str(nbytes), str(step_s), str(steps)],
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
             for r in range(ranks)]
    out = procs[0].communicate()[0]
    if any(p.wait() for p in procs):
        raise SystemExit(f"a floor rank failed:\n{out}")
    bare, moved = out.split()[-2:]
    return float(bare), float(moved)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--floor-worker":
        r, w, port, nbytes, step_s, steps = sys.argv[2:8]
        return floor_worker(int(r), int(w), port, int(nbytes), float(step_s), int(steps))
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainer", default="target/release/fsdp-trainer")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--runs", type=int, default=3)
    # (at least 3 log windows of 10 steps, and the floor leaves its first 10 steps out)
    ap.add_argument("--ranks", default="2,3")
    a = ap.parse_args()
    if a.steps < 30:
        ap.error("--steps must be at least 30: the step time is the median of 10-step windows after the first")
    print(f"machine: {os.cpu_count()} cpus; {a.steps} steps a run, {a.runs} runs of each, alternated")
    rows = []
    with tempfile.TemporaryDirectory(prefix="snapshot-cost-") as workdir:
        for ranks in (int(r) for r in a.ranks.split(",")):
            steps, walls, own = {0: [], 1: []}, {0: [], 1: []}, ""
            for _ in range(a.runs):
                for freq in (0, 1):
                    wall, step, said = run(a.trainer, ranks, a.steps, freq, workdir)
                    steps[freq].append(step)
                    walls[freq].append(wall)
                    own = said or own
                    print(f"  {ranks} ranks --snapshot_freq {freq}: step {1e3 * step:.1f} ms, wall {wall:.2f} s  {said}",
                          flush=True)
            off, on = statistics.median(steps[0]), statistics.median(steps[1])
            held = re.search(r"own ([0-9.]+)", own)
            nbytes = int(float(held.group(1)) / 2 * (1 << 20)) if held else 0
            bare, moved = [], []
            for _ in range(a.runs):
                b, m = floor(ranks, nbytes, off, a.steps)
                bare.append(b)
                moved.append(m)
                print(f"  {ranks} ranks floor ({nbytes / (1 << 20):.1f} MiB a step each way): "
                      f"{1e3 * bare[-1]:.1f} → {1e3 * moved[-1]:.1f} ms", flush=True)
            fl = statistics.median(moved) - statistics.median(bare)
            rows.append((ranks, off, on, statistics.median(walls[0]), statistics.median(walls[1]), own,
                         fl, statistics.median(bare)))
    print()
    print("| ranks on this machine | step without | step with snapshots | overhead | the floor: moving the bytes | overhead / floor | the trainer's account | wall without → with |")
    print("|---|---|---|---|---|---|---|---|")
    for ranks, off, on, w0, w1, own, fl, bare in rows:
        account = re.search(r"([0-9.]+) ms each, ([0-9.]+)% of the time in steps", own)
        said = f"{account.group(1)} ms a snapshot, {account.group(2)}%" if account else "–"
        cost = on - off
        ratio = f"{cost / fl:.2f}" if fl > 0 else "–"
        print(f"| {ranks} | {1e3 * off:.1f} ms | {1e3 * on:.1f} ms | **{1e3 * cost:+.1f} ms, {100 * cost / off:+.1f}%** | "
              f"{1e3 * fl:+.1f} ms, {100 * fl / bare:+.1f}% | **{ratio}** | {said} | {w0:.2f} → {w1:.2f} s |")


if __name__ == "__main__":
    main()
