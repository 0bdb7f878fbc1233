"""What peer-memory snapshots cost a step: fsdp-trainer ranks on Gloo (no agent: the
snapshots are taken because FSDP_AGENT_CONTROL is set), in pairs within one run.

Runs of the same flags on this machine differ by 10% in step time, more than the cost
measured, so the cost is read inside each run: with `--snapshot_freq 3` the steps come in
threes, and every rank reports each step over the progress channel (FSDP_AGENT_PROGRESS,
read here as an agent reads it). Rank 0's step n is timed from its report of step n-1 to
that of step n:
  n % 3 == 0   the step, then the snapshot taken and its copy to the buddy started;
  n % 3 == 1   the step while that copy is in flight, then its fence;
  n % 3 == 2   a step with no snapshot work: the healthy step.
The cost of a snapshot is (median of the first kind - healthy) + (median of the second -
healthy); at `--snapshot_freq 1` (the default) every step pays it, so the overhead is that
cost over the healthy step. The first 10 steps are left out. The trainer's own account
("Snapshots: N taken, X ms each": the time its step loop spends taking a snapshot, starting
its copy and waiting at the fence) is printed beside it.

Two ranks on two cores is a rank per core, as on a real node; three ranks on two cores
share them, so the copy's work on Gloo's threads takes time from the steps.

The **floor**, measured in the same run: what moving the same bytes costs a step on this
machine with nothing of the trainer in it. Plain torch.distributed Gloo ranks run a compute
loop as long as the trainer's step, in blocks of 10 steps without and with copying a buffer
the size of a rank's part and sending it to the next rank (isend/irecv, overlapping the
next step, as the snapshots do). On a machine whose cores all train there is no idle core
for the copy's kernel and Gloo work, so no off-node copy can cost less than this; the
snapshots' overhead is given as a ratio to it.

usage: python bench/snapshot_cost.py [--trainer target/release/fsdp-trainer] [--steps 240] [--runs 3]
                                     [--ranks 2,3]
"""
import argparse
import os
import re
import socket
import statistics
import subprocess
import tempfile
import threading
import sys
import time

MODEL = ["--hidden_width", "128", "--num_layers", "4", "--intermediate_size", "344", "--num_heads", "8",
         "--num_key_value_heads", "4", "--max_context_width", "64", "--threads", "1"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(trainer, ranks, steps, workdir):
    """One run at --snapshot_freq 3: (healthy step s, cost of a snapshot s, the trainer's
    own account of its snapshots)."""
    port = free_port()
    inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    inbox.bind(os.path.join(workdir, f"progress{port}"))
    heard = []

    def listen():
        # Read at once, as an agent does: an unread datagram socket holds a few reports.
        while True:
            try:
                text = inbox.recv(256).decode()
            except OSError:
                return
            heard.append((time.monotonic(), text))

    threading.Thread(target=listen, daemon=True).start()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   FSDP_AGENT_CONTROL=os.path.join(workdir, f"ctl{r}"),
                   FSDP_AGENT_PROGRESS=os.path.join(workdir, f"progress{port}"))
        procs.append(subprocess.Popen([trainer, *MODEL, "--max_steps", str(steps), "--logging_freq", str(steps),
                                       "--snapshot_freq", "3"], env=env, text=True,
                                      stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL))
    out = procs[0].communicate()[0]
    codes = [p.wait() for p in procs]
    inbox.close()
    if any(codes):
        raise SystemExit(f"a rank failed: {codes}\n{out}")
    at = {}
    for t, text in heard:
        words = text.split()
        if words[:2] == ["0", "step"]:
            at.setdefault(int(words[2]), t)
    kinds = {0: [], 1: [], 2: []}
    for n in range(11, steps + 1):
        if n in at and n - 1 in at:
            kinds[n % 3].append(at[n] - at[n - 1])
    if min(len(k) for k in kinds.values()) < 5:
        raise SystemExit(f"too few step reports to time steps: {len(at)} of {steps}")
    taken, copied, healthy = (statistics.median(kinds[k]) for k in (0, 1, 2))
    own = re.search(r"Snapshots: \d+ taken, .*", out)
    return healthy, (taken - healthy) + (copied - healthy), own.group(0) if own else ""


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
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", default="2,3")
    a = ap.parse_args()
    if a.steps < 60:
        ap.error("--steps must be at least 60: the first 10 are left out and each kind of step needs its share")
    print(f"machine: {os.cpu_count()} cpus; {a.steps} steps a run, {a.runs} runs")
    rows = []
    with tempfile.TemporaryDirectory(prefix="snapshot-cost-") as workdir:
        for ranks in (int(r) for r in a.ranks.split(",")):
            healthy, cost, own = [], [], ""
            for _ in range(a.runs):
                h, c, said = run(a.trainer, ranks, a.steps, workdir)
                healthy.append(h)
                cost.append(c)
                own = said or own
                print(f"  {ranks} ranks: healthy step {1e3 * h:.1f} ms, a snapshot costs {1e3 * c:+.1f} ms "
                      f"({100 * c / h:+.1f}%)  {said}", flush=True)
            step, c = statistics.median(healthy), statistics.median(cost)
            held = re.search(r"own ([0-9.]+)", own)
            nbytes = int(float(held.group(1)) / 2 * (1 << 20)) if held else 0
            floors = []
            for _ in range(a.runs):
                bare, moved = floor(ranks, nbytes, step, a.steps)
                floors.append((bare, moved))
                print(f"  {ranks} ranks floor ({nbytes / (1 << 20):.1f} MiB a step each way): "
                      f"{1e3 * bare:.1f} → {1e3 * moved:.1f} ms ({1e3 * (moved - bare):+.1f} ms)", flush=True)
            fl = statistics.median(m - b for b, m in floors)
            rows.append((ranks, step, c, own, fl, statistics.median(b for b, _ in floors)))
    print()
    print("| ranks on this machine | healthy step | a snapshot costs (every step at --snapshot_freq 1) | the floor: moving the bytes | overhead / floor | the trainer's account |")
    print("|---|---|---|---|---|---|")
    for ranks, step, c, own, fl, bare in rows:
        account = re.search(r"([0-9.]+) ms each, ([0-9.]+)% of the time in steps", own)
        said = f"{account.group(1)} ms a snapshot" if account else "–"
        ratio = f"{c / fl:.2f}" if fl > 0 else "–"
        print(f"| {ranks} | {1e3 * step:.1f} ms | **{1e3 * c:+.1f} ms, {100 * c / step:+.1f}%** | "
              f"{1e3 * fl:+.1f} ms, {100 * fl / bare:+.1f}% | **{ratio}** | {said} |")


if __name__ == "__main__":
    main()
