"""Elastic benchmark: fsdp-agent (on etcd, and on c10d: the store its pod0 serves) against
torchrun (c10d and etcd-v2 backends), same worker
script (tests/py/elastic_worker.py: gloo all-reduce loop with a checkpointed step), same
machine, same run. Each "pod" is a launcher in its own PID+UTS namespace
(`unshare --pid --uts --fork --kill-child`), so SIGKILL of a pod kills everything in it.

Figures:
  startup-N   last pod started -> every worker of the N-node group running (its "start" line)
  reform-KILL 3 pods, SIGKILL of one -> both survivors' workers running again in a group of 2
  reform-TERM the same with SIGTERM (a pod delete)
  scaleup-3   2 pods running (nnodes 2:3), a third started -> every worker running in a group of 3

usage: python bench/elastic.py [--runs 3] [--agent target/release/fsdp-agent] [--timeout 60] [--json FILE]
Needs: etcd on PATH, unshare, root, python-etcd in this interpreter's environment.
"""
import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests/py/elastic_worker.py")
REFORMED = {}  # scenario -> seconds from the kill to fsdp-agent's "group formed" line


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    def __init__(self, v2):
        self.dir = tempfile.mkdtemp(prefix="bench-etcd-")
        self.port, peer = free_port(), free_port()
        url = f"http://127.0.0.1:{self.port}"
        args = ["etcd", "--data-dir", self.dir + "/d", "--listen-client-urls", url, "--advertise-client-urls", url,
                "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"default=http://127.0.0.1:{peer}", "--log-level", "error"]
        if v2:
            args.append("--enable-v2")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                time.sleep(0.3)
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("etcd did not start")

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Pod:
    def __init__(self, name, argv, workdir, env):
        self.name = name
        self.out_path = os.path.join(workdir, f"{name}.{time.monotonic_ns()}.log")
        self.out = open(self.out_path, "w")
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--uts", "--fork", "--kill-child", "sh", "-c", 'hostname "$0" && exec "$@"', name] + argv,
            stdout=self.out, stderr=subprocess.STDOUT, env=env)

    def starts(self):
        with open(self.out_path, errors="replace") as f:
            return [line for line in f if "start host=" in line]

    def worlds(self):
        return [int(l.split("world=")[1].split()[0]) for l in self.starts()]

    def formed_after(self, wall0):
        """Seconds from wall0 to this agent's first 'group formed' line after it."""
        import datetime
        with open(self.out_path, errors="replace") as f:
            for line in f:
                if "group formed" in line:
                    ts = datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()
                    if ts > wall0:
                        return ts - wall0
        return None

    def agent_pid(self):
        for _ in range(200):
            try:
                with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                    kids = f.read().split()
                if kids:
                    return int(kids[0])
            except OSError:
                pass
            time.sleep(0.01)
        raise RuntimeError("no agent in pod")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def term(self):
        os.kill(self.agent_pid(), signal.SIGTERM)


def descendants(root):
    """Every process below pid `root` (children, their children, ...), from /proc."""
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], list(kids.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def launcher_argv(kind, agent, endpoint, run_id, nnodes, index, ckpt):
    addr = f"127.0.{10 + index}.1"
    worker = [WORKER, ckpt, "1000000"]
    if kind.startswith("fsdp-agent"):
        backend, conf = "etcd", "last_call_timeout=1"
        if kind == "fsdp-agent-c10d":
            # As torchrun-c10d below: pod0 serves the store and another pod is killed.
            backend, conf = "c10d", conf + ",is_host=" + ("1" if index == 0 else "0")
        extra = ["--prewarm"] if kind == "fsdp-agent-prewarm" else []
        return [agent, "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--nnodes", nnodes,
                "--nproc-per-node", "1", "--local-addr", addr, "--rdzv-conf", conf,
                "--term-timeout", "5"] + extra + worker
    backend = "c10d" if kind == "torchrun-c10d" else "etcd-v2"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # torchrun only recovers from a peer's death when the survivors' workers fail and it
    # restarts them, so it gets a restart budget; fsdp-agent runs with --max-restarts 0.
    conf = "last_call_timeout=1"
    if kind == "torchrun-c10d":
        # pod0 hosts the c10d store (the benchmark kills pod2), so torchrun is not measured
        # on its single point of failure but on its recovery path.
        conf += ",is_host=" + ("1" if index == 0 else "0")
    return [torchrun, "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--nnodes", nnodes,
            "--nproc-per-node", "1", "--local-addr", addr, "--max-restarts", "3",
            "--rdzv-conf", conf, "--monitor-interval", "0.1"] + worker


def wait(cond, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return time.monotonic()
        time.sleep(0.01)
    return None


def scenario(kind, name, args, env, workdir):
    """Returns seconds, or None when the launcher did not get there within the timeout."""
    c10d = kind.endswith("-c10d")
    etcd = None if c10d else Etcd(v2=(kind == "torchrun-etcd-v2"))
    endpoint = f"127.0.10.1:{free_port()}" if c10d else f"127.0.0.1:{etcd.port}"
    ckpt = tempfile.mkdtemp(prefix="bench-ckpt-", dir=workdir)
    run_id = f"b{time.monotonic_ns()}"
    pods = []
    try:
        n = int(name.split("-")[1]) if name.startswith("startup") else 3
        nnodes = f"{n}:{n}" if name.startswith("startup") else "2:3"
        first = 2 if name.startswith("scaleup") else n
        for i in range(first):
            pods.append(Pod(f"pod{i}", launcher_argv(kind, args.agent, endpoint, run_id, nnodes, i, ckpt), workdir, env))
        t_last = time.monotonic()
        if name.startswith("scaleup"):
            if wait(lambda: all(2 in p.worlds() for p in pods), args.timeout) is None:
                return None
            time.sleep(1)  # let training run
            t_last = time.monotonic()
            pods.append(Pod("pod2", launcher_argv(kind, args.agent, endpoint, run_id, nnodes, 2, ckpt), workdir, env))
        t_all = wait(lambda: all(n in p.worlds() for p in pods), args.timeout)
        if t_all is None and args.keep:
            print(f"  [{kind} {name}: not there; logs: {[p.out_path for p in pods]}]", flush=True)
        if name.startswith("startup") or name.startswith("scaleup"):
            return None if t_all is None else t_all - t_last
        if t_all is None:
            return None
        time.sleep(2)  # let training run
        before = [len(p.starts()) for p in pods[:2]]
        t0 = time.monotonic()
        pods[2].kill() if name == "reform-KILL" else pods[2].term()
        wall0 = time.time()
        done = wait(lambda: all(p.worlds()[b:].count(2) > 0 for p, b in zip(pods[:2], before)), args.timeout)
        if kind == "fsdp-agent":
            formed = [p.formed_after(wall0) for p in pods[:2]]
            if all(f is not None for f in formed):
                REFORMED.setdefault(name, []).append(max(formed))
        if done is None and args.keep:  # reform scenarios
            print(f"  [{kind} {name}: no recovery; logs: {[p.out_path for p in pods]}]", flush=True)
        return None if done is None else done - t0
    finally:
        for p in pods:
            p.kill()
        if etcd:
            etcd.stop()


def pod_env():
    """The environment every pod's launcher gets: this interpreter (the one with torch),
    loopback gloo, quiet torchrun."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", LOGLEVEL="WARNING", RUST_LOG="info", PYTHON=sys.executable,
               PATH=os.path.dirname(sys.executable) + ":" + os.environ["PATH"])
    # Every pod's status server on its own port (they share this host's network); peers
    # reach it there for the ring liveness check.
    env.setdefault("FSDP_STATUS_ADDR", "127.0.0.1:0")
    return env


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--agent", default=os.path.join(ROOT, "target/release/fsdp-agent"))
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--scenarios", default="startup-2,startup-4,reform-TERM,reform-KILL,scaleup-3")
    ap.add_argument("--json", help="also write the results here as JSON")
    ap.add_argument("--kinds", default="fsdp-agent,fsdp-agent-c10d,torchrun-c10d,torchrun-etcd-v2")
    ap.add_argument("--keep", action="store_true", help="keep logs of runs that did not recover")
    args = ap.parse_args()
    env = pod_env()
    workdir = tempfile.mkdtemp(prefix="bench-elastic-")
    print(f"machine: {os.cpu_count()} cpus; runs={args.runs}; timeout={args.timeout}s")
    results = {}
    for name in args.scenarios.split(","):
        for kind in args.kinds.split(","):
            xs = [scenario(kind, name, args, env, workdir) for _ in range(args.runs)]
            results[(name, kind)] = xs
            ok = [x for x in xs if x is not None]
            med = f"{statistics.median(ok):.2f}" if ok else "-"
            spread = f"[{min(ok):.2f}-{max(ok):.2f}]" if ok else ""
            fails = len(xs) - len(ok)
            print(f"{name:12} {kind:18} median_s={med} {spread} not_within_timeout={fails}/{len(xs)}", flush=True)
    print("\n| scenario | launcher | median s [min-max] | runs that did not get there within the timeout | ratio to fsdp-agent |")
    print("|---|---|---|---|---|")
    for (name, kind), xs in results.items():
        ok = [x for x in xs if x is not None]
        ours = [x for x in results[(name, "fsdp-agent")] if x is not None] if (name, "fsdp-agent") in results else []
        ratio = f"{statistics.median(ok) / statistics.median(ours):.1f}x" if ok and ours and kind != "fsdp-agent" else ""
        cell = f"{statistics.median(ok):.2f} [{min(ok):.2f}-{max(ok):.2f}]" if ok else "never"
        print(f"| {name} | {kind} | {cell} | {len(xs) - len(ok)}/{len(xs)} | {ratio} |")
    for name, xs in REFORMED.items():
        print(f"fsdp-agent {name}: kill -> new group formed (agent log) median {statistics.median(xs):.3f} s "
              f"[{min(xs):.3f}-{max(xs):.3f}]; the rest of the figure is the workers' own start (python + torch import + gloo)")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"runs": args.runs, "timeout_s": args.timeout,
                       "results": [{"scenario": n, "launcher": k, "seconds": xs} for (n, k), xs in results.items()],
                       "agent_group_formed_s": REFORMED}, f, indent=1)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
