#!/usr/bin/env python3
"""Real agents at scale: N fsdp-agent processes (one `sleep` worker each) on one local etcd.

Forms one round of N, then takes one node out and times the survivors' re-form from their own
`group formed` log lines: `--how kill` (SIGKILL: the lost lease expires after the TTL) or
`--how term` (SIGTERM: the leaving agent revokes its lease). Prints one line per run:

    agents=N how=kill form_s=... spawn_s=... reform_s=... p50_s=... p99_s=... exited=0 fenced=0 writes=...

`writes` is how far etcd's revision moved during the re-form (one per put, delete or
transaction that changed something); `proposals` counts every raft proposal committed
(lease grants and revokes, and transactions whose compare failed, too); `ranges` the reads.

`exited` counts agents other than the lost one that ended (it must be 0); `fenced`, the
survivors that fenced themselves because etcd answered their keep-alives too late (0 when
etcd keeps up).

With `--floor target/release/agent-floor`, the same N processes and workers run the least
an agent can do instead (tests/src/bin/agent_floor.rs: a lease, a registration, one
watched round key that node 0 rewrites on every change, the worker stopped and started
again): the floor this machine and etcd set under the agents' figures.

Usage: bench/agents_scale.py --agent target/release/fsdp-agent --nodes 256 [--how kill|term]
       [--ttl 5] [--runs 1] [--no-liveness] [--floor target/release/agent-floor]
"""

import argparse
import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stamp(line):
    """The UTC time at the start of an agent log line, in seconds since the epoch."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z", line)
    if not m:
        return None
    t = datetime.datetime.strptime(m.group(1)[:26], "%Y-%m-%dT%H:%M:%S.%f")
    return t.replace(tzinfo=datetime.timezone.utc).timestamp()


def formed(path, world):
    """Times of `group formed ... world_size=<world>` lines in an agent's log."""
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if "group formed" in line and f"world_size={world} " in line:
                    out.append(stamp(line))
    except FileNotFoundError:
        pass
    return [t for t in out if t]


def metrics(port):
    """etcd's own counters of what it did: raft proposals committed (every write, lease
    grant and revoke, and every transaction, whether its compare held or not), puts,
    deletes, ranges, the revision's height, and the events it sent to watchers."""
    import urllib.request
    want = {"etcd_server_proposals_committed_total": "proposals", "etcd_mvcc_put_total": "puts",
            "etcd_mvcc_delete_total": "deletes", "etcd_mvcc_range_total": "ranges",
            "etcd_mvcc_txn_total": "txns", "etcd_debugging_mvcc_current_revision": "revision",
            "etcd_debugging_mvcc_events_total": "events"}
    out = dict.fromkeys(want.values(), 0.0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            name, _, value = line.partition(" ")
            if name in want:
                out[want[name]] = float(value)
    return out


def cpu_busy(seconds):
    """The share of the machine's CPU time spent busy over the next `seconds` (/proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = list(map(int, f.readline().split()[1:]))
        return sum(v), v[3] + v[4]
    (t0, i0), _ = sample(), time.sleep(seconds)
    t1, i1 = sample()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def cpu_ms(pids):
    """CPU time (ms) the processes `pids` have used so far, from the scheduler's own count
    in nanoseconds (/proc/PID/schedstat): /proc/PID/stat's clock ticks round each process
    down to 10 ms, which a process that works 2 ms per re-form mostly stays under. Every
    thread counts (an exited one's time is lost: the agents' threads live long)."""
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except (FileNotFoundError, ProcessLookupError):
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    return total / 1e6


def rounds(path):
    """How many `group formed` lines an agent's log has."""
    try:
        with open(path, errors="replace") as f:
            return sum(1 for line in f if "group formed" in line)
    except FileNotFoundError:
        return 0


def wait(what, cond, limit):
    end = time.time() + limit
    while not cond():
        if time.time() > end:
            sys.exit(f"agents_scale: timed out after {limit} s waiting for {what}")
        time.sleep(0.2)


def stop(agents, patience):
    """SIGTERM to every agent still running, all at once (a job deleted); a SIGKILL for one
    that has not exited after waiting `patience` seconds for it (each in turn)."""
    for p in agents:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in agents:
        try:
            p.wait(timeout=patience)
        except subprocess.TimeoutExpired:
            p.kill()


def run(a, tmp):
    port, peer = free_port(), free_port()
    # etcd's data on a disk, as a real etcd's is: its writes wait for fsync.
    data = tempfile.mkdtemp(prefix="agents-scale-etcd-")
    etcd = subprocess.Popen(
        ["etcd", "--name", "s", "--data-dir", data,
         "--listen-client-urls", f"http://127.0.0.1:{port}", "--advertise-client-urls", f"http://127.0.0.1:{port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"s=http://127.0.0.1:{peer}", "--log-level", "error", "--quota-backend-bytes", str(4 << 30)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    agents, logs = [], []
    try:
        time.sleep(1.5)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        # Each agent serves its status port on its own loopback port: its ring neighbour
        # watches it there (a SIGKILLed agent is evicted when the port refuses).
        env.update(RUST_LOG=os.environ.get("RUST_LOG", "info"), FSDP_STATUS_ADDR="127.0.0.1:0" if a.liveness else "off")
        # The agents' own temporary files (their progress sockets) go with the logs, and
        # go when the run's directory does.
        env["TMPDIR"] = os.path.join(tmp, "tmp")
        os.mkdir(env["TMPDIR"])
        start = time.time()
        for i in range(a.nodes):
            log = os.path.join(tmp, f"agent{i}.log")
            logs.append(log)
            if a.floor:
                argv = [a.floor, "--endpoint", f"127.0.0.1:{port}", "--run", "scale", "--node", str(i),
                        "--nodes", str(a.nodes), "--ttl", str(a.ttl), "--", "/bin/sleep", "3600"]
            else:
                argv = [a.agent, "--nnodes", f"{a.nodes - 1}:{a.nodes}", "--nproc-per-node", "1",
                        "--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "scale",
                        "--rdzv-conf", f"keep_alive_ttl={a.ttl},last_call_timeout=5,straggler_timeout={4 * a.ttl}",
                        "--local-addr", "127.0.0.1", "--log-dir", "/dev/null", "--no-python", "/bin/sleep", "3600"]
            agents.append(subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env))
        # One script starting N processes one after another: on two cores this alone is
        # seconds, which a real job (every agent on its own machine) does not pay.
        spawn_s = time.time() - start
        wait(f"a round of {a.nodes}", lambda: all(formed(p, a.nodes) for p in logs), 300)
        form_s = max(formed(p, a.nodes)[0] for p in logs) - start
        # What each agent used to start and form (its threads still alive).
        form_cpu_ms = cpu_ms([p.pid for p in agents]) / a.nodes
        time.sleep(2)
        # What a formed group costs while nothing happens (keep-alives, liveness streams).
        idle = cpu_busy(a.idle) if a.idle else 0.0
        victim = a.nodes - 1
        before = metrics(port)
        cpu_before = cpu_ms([p.pid for p in agents])
        if a.on_kill:
            # A profiler, say, started just before the node goes (the command is the shell's).
            subprocess.Popen(a.on_kill, shell=True)
            time.sleep(0.5)
        t0 = time.time()
        agents[victim].send_signal(signal.SIGKILL if a.how == "kill" else signal.SIGTERM)
        survivors = [p for i, p in enumerate(logs) if i != victim]
        wait(f"the survivors' round of {a.nodes - 1}", lambda: all(formed(p, a.nodes - 1) for p in survivors),
             120 + 4 * a.ttl)
        reform_s = max(formed(p, a.nodes - 1)[0] for p in survivors) - t0
        times = sorted(formed(p, a.nodes - 1)[0] - t0 for p in survivors)
        p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]
        # The re-form's cost in etcd: what it did from the kill until one second after the
        # last survivor formed (nothing else happens in a formed group but keep-alives).
        time.sleep(1)
        after = metrics(port)
        agent_ms = (cpu_ms([p.pid for p in agents]) - cpu_before) / max(1, a.nodes - 1)
        cost = {k: int(after[k] - before[k]) for k in after}
        settled = [rounds(p) for p in survivors]
        if a.hold:
            time.sleep(a.hold)
        further = sum(rounds(p) - n for p, n in zip(survivors, settled))
        exited = sum(1 for i, p in enumerate(agents) if i != victim and p.poll() is not None)
        fence_lines = [line for p in survivors for line in open(p, errors="replace")
                       if "fencing: stopping the workers" in line]
        fenced = sum(1 for p in survivors if "fencing: stopping the workers" in open(p, errors="replace").read())
        if fence_lines:
            print(f"agents_scale: {len(fence_lines)} fences, the first: {fence_lines[0].strip()[:400]}", flush=True)
        print(f"agents={a.nodes} {'floor=1 ' if a.floor else ''}how={a.how} liveness={'on' if a.liveness else 'off'} form_s={form_s:.3f} "
              f"spawn_s={spawn_s:.3f} reform_s={reform_s:.3f} p50_s={p50:.3f} p99_s={p99:.3f} exited={exited} fenced={fenced} "
              f"writes={cost['revision']} proposals={cost['proposals']} puts={cost['puts']} "
              f"deletes={cost['deletes']} txns={cost['txns']} ranges={cost['ranges']} "
              f"further_rounds={further} held_s={a.hold} idle_busy={idle:.2f} "
              f"agent_cpu_ms={agent_ms:.2f} form_cpu_ms={form_cpu_ms:.2f}", flush=True)
        # The whole run leaves at once (a job deleted): what that costs etcd, which a run
        # starting beside it on the same machines pays for too.
        before, etcd_cpu = metrics(port), cpu_ms([etcd.pid])
        # The agents' own CPU from here until each exits: what they used by the end (counted
        # for children once waited for) less what their live threads had used so far. An
        # upper bound: a thread that exited before now counts in it.
        import resource
        waited = resource.getrusage(resource.RUSAGE_CHILDREN)
        lived_ms = cpu_ms([p.pid for p in agents if p.poll() is None])
        t0 = time.time()
        stop(agents, 60)
        gone_s = time.time() - t0
        after = metrics(port)
        now = resource.getrusage(resource.RUSAGE_CHILDREN)
        agents_cpu = now.ru_utime + now.ru_stime - waited.ru_utime - waited.ru_stime - lived_ms / 1000
        print(f"agents={a.nodes} teardown_s={gone_s:.3f} teardown_events={int(after['events'] - before['events'])} "
              f"teardown_writes={int(after['revision'] - before['revision'])} "
              f"teardown_etcd_cpu_ms={cpu_ms([etcd.pid]) - etcd_cpu:.0f} "
              f"teardown_agents_cpu_ms={agents_cpu * 1000:.0f}", flush=True)
    finally:
        stop(agents, 30)
        etcd.kill()
        etcd.wait()
        shutil.rmtree(data, ignore_errors=True)


def default_dir():
    """A memory file system when there is one (for the logs and the agents' TMPDIR; etcd's
    data stays in the system's temporary directory, on disk): N agents on one host make N socket
    directories and N logs in one directory, on one disk, and remove them at the end,
    run after run. On ext4 that made each new file cost a scan of the recently freed
    inodes (`recently_deleted` in perf: a third of each agent's start, and seconds of
    spread between runs of the same binary), which a node with a disk of its own never
    pays."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agent", required=True)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--how", choices=["kill", "term"], default="kill")
    ap.add_argument("--ttl", type=int, default=5)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--on-kill", help="a shell command started half a second before the node is taken out")
    ap.add_argument("--idle", type=float, default=5,
                    help="seconds over which the formed group's CPU load is sampled before the kill")
    ap.add_argument("--keep", action="store_true", help="keep the agents' logs (the path is printed)")
    ap.add_argument("--hold", type=int, default=0,
                    help="after the re-form, watch this many seconds for further rounds (there must be none)")
    ap.add_argument("--no-liveness", dest="liveness", action="store_false",
                    help="no status ports: a SIGKILL is noticed by the lease alone")
    ap.add_argument("--floor", help="the agent-floor binary: run the least an agent can do instead of --agent")
    ap.add_argument("--dir", default=default_dir(),
                    help="where the run's logs and the agents' TMPDIR go (etcd's data stays on disk) (default: /dev/shm when "
                         "writable, else the system's temporary directory)")
    a = ap.parse_args()
    for _ in range(a.runs):
        tmp = tempfile.mkdtemp(prefix="agents-scale-", dir=a.dir)
        try:
            run(a, tmp)
        finally:
            if a.keep:
                print(f"agents_scale: logs kept in {tmp}", flush=True)
            else:
                shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
