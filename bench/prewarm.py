"""Pre-warm benchmark: how soon the workers are training again, measured where it matters:
the first all-reduce of the new group completing in the workers themselves (the
`allreduced ... t=` line of tests/py/elastic_worker.py, wall clock, same machine).

Launchers, side by side in one run (pods as in bench/elastic.py: PID+UTS namespaces):
  fsdp-agent-prewarm  fsdp-agent --prewarm (a spare interpreter per rank, torch imported)
  fsdp-agent          fsdp-agent, cold worker starts
  torchrun-c10d       torchrun, c10d backend (pod0 hosts the store)
  torchrun-etcd-v2    torchrun, etcd-v2 backend

Scenarios:
  reform-TERM  3 pods (nnodes 2:3), SIGTERM to one -> both survivors' first all-reduce at 2
  crash        2 pods, SIGKILL of one worker -> every rank's first all-reduce after the restart
  startup-3    3 pods started together -> every rank's first all-reduce (from the last start)
Also: the idle RSS of a spare.

usage: python bench/prewarm.py [--runs 3] [--agent target/release/fsdp-agent] [--json FILE]
                               [--scenarios ...] [--kinds ...] [--settle 10] [--spare-wait 15]
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic  # noqa: E402  (the pods, etcd and launcher command lines)

KINDS = "fsdp-agent-prewarm,fsdp-agent,torchrun-c10d,torchrun-etcd-v2"


def allreduced(pod):
    """(world, wall time) of every first all-reduce of a group in this pod."""
    with open(pod.out_path, errors="replace") as f:
        return [(int(l.split("world=")[1].split()[0]), float(l.split(" t=")[1]))
                for l in f if l.startswith("allreduced ") or "]:allreduced " in l]


def argv(kind, args, endpoint, run_id, nnodes, i, ckpt):
    a = elastic.launcher_argv(kind, args.agent, endpoint, run_id, nnodes, i, ckpt)
    if kind.startswith("fsdp-agent"):
        # The crash scenario needs a restart budget (torchrun gets 3 in elastic.py).
        a[1:1] = ["--max-restarts", "3"]
    return a


def worker_host_pid(pod):
    """The host pid of the pod's worker (the process whose in-namespace pid its start line names)."""
    inner = int(pod.starts()[-1].split("pid=")[1].split()[0])
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                ns = next(l for l in f if l.startswith("NSpid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if len(ns) == 2 and int(ns[1]) == inner and pod_owns(pod, int(entry)):
            return int(entry)
    raise RuntimeError("worker not found")


def pod_owns(pod, pid):
    """Whether pid descends from the pod's unshare process."""
    while pid > 1:
        if pid == pod.proc.pid:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def scenario(kind, name, args, env, workdir):
    c10d = kind.endswith("-c10d")
    etcd = None if c10d else elastic.Etcd(v2=(kind == "torchrun-etcd-v2"))
    endpoint = f"127.0.10.1:{elastic.free_port()}" if c10d else f"127.0.0.1:{etcd.port}"
    ckpt = tempfile.mkdtemp(prefix="bench-ckpt-", dir=workdir)
    run_id = f"p{time.monotonic_ns()}"
    n = 2 if name == "crash" else 3
    nnodes = "2:3" if name == "reform-TERM" else f"{n}:{n}"
    pods = []
    try:
        for i in range(n):
            pods.append(elastic.Pod(f"pod{i}", argv(kind, args, endpoint, run_id, nnodes, i, ckpt), workdir, env))
        t_last = time.time()
        if elastic.wait(lambda: all(any(w == n for w, _ in allreduced(p)) for p in pods), args.timeout) is None:
            return None
        if name == "startup-3":
            return max(min(t for w, t in allreduced(p) if w == n) for p in pods) - t_last
        # Training runs and the spares for the next start finish importing (a few seconds;
        # failures come minutes apart, not while the last start's spares still import).
        time.sleep(args.settle)
        survivors = pods[:2]
        before = [len(allreduced(p)) for p in survivors]
        if name == "reform-TERM":
            t0 = time.time()
            pods[2].term()
            world = 2
        else:
            pid = worker_host_pid(pods[1])
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
            world = 2
        if elastic.wait(lambda: all(any(w == world for w, _ in allreduced(p)[b:]) for p, b in zip(survivors, before)),
                        args.timeout) is None:
            if args.keep:
                print(f"  [{kind} {name}: no recovery; logs: {[p.out_path for p in pods]}]", flush=True)
            return None
        return max(min(t for w, t in allreduced(p)[b:] if w == world) for p, b in zip(survivors, before)) - t0
    finally:
        for p in pods:
            p.kill()
        if etcd:
            etcd.stop()


def spare_rss(args, env, workdir):
    """VmRSS of an idle spare (torch imported), in MiB."""
    ckpt = tempfile.mkdtemp(prefix="bench-ckpt-", dir=workdir)
    agent = subprocess.Popen([args.agent, "--standalone", "--nproc-per-node", "1", "--prewarm", elastic.WORKER, ckpt,
                              "1000000"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(args.spare_wait)  # the worker runs; the next spare has imported torch
        with open(f"/proc/{agent.pid}/task/{agent.pid}/children") as f:
            kids = [int(p) for p in f.read().split()]

        def started(pid):
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[19])

        spare = max(kids, key=started)  # the newest child: the spare for the next start
        with open(f"/proc/{spare}/status") as f:
            rss_kb = int(next(l for l in f if l.startswith("VmRSS:")).split()[1])
        return rss_kb / 1024
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--agent", default=os.path.join(elastic.ROOT, "target/release/fsdp-agent"))
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--scenarios", default="reform-TERM,crash,startup-3")
    ap.add_argument("--kinds", default=KINDS)
    ap.add_argument("--json", help="also write the results here as JSON")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--settle", type=float, default=10, help="seconds of training before the fault")
    ap.add_argument("--spare-wait", dest="spare_wait", type=float, default=15,
                    help="seconds after the start before the idle spare's RSS is read (0: not read)")
    args = ap.parse_args()
    env = elastic.pod_env()
    workdir = tempfile.mkdtemp(prefix="bench-prewarm-")
    print(f"machine: {os.cpu_count()} cpus; runs={args.runs}; timeout={args.timeout}s")
    results = {}
    for name in args.scenarios.split(","):
        for kind in args.kinds.split(","):
            xs = [scenario(kind, name, args, env, workdir) for _ in range(args.runs)]
            results[(name, kind)] = xs
            ok = [x for x in xs if x is not None]
            med = f"{statistics.median(ok):.2f}" if ok else "-"
            print(f"{name:12} {kind:20} first all-reduce median_s={med} all={['-' if x is None else round(x, 2) for x in xs]}",
                  flush=True)
    rss = spare_rss(args, env, workdir) if args.spare_wait > 0 else None
    if rss is not None:
        print(f"idle spare (torch imported) VmRSS: {rss:.0f} MiB")
    print("\n| scenario | " + " | ".join(args.kinds.split(",")) + " |")
    print("|---|" + "---|" * len(args.kinds.split(",")))
    for name in args.scenarios.split(","):
        cells = []
        for kind in args.kinds.split(","):
            ok = [x for x in results[(name, kind)] if x is not None]
            never = len(results[(name, kind)]) - len(ok)
            cell = f"{statistics.median(ok):.2f} s" if ok else "never"
            cells.append(cell + (f" ({never}/{len(results[(name, kind)])} never)" if ok and never else ""))
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": args.runs, "timeout_s": args.timeout, "settle_s": args.settle, "spare_rss_mib": rss,
                       "results": [{"scenario": n, "launcher": k, "seconds": xs} for (n, k), xs in results.items()]},
                      f, indent=1)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
