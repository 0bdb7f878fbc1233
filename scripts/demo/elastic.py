#!/usr/bin/env python3
"""The elastic demo: three "nodes" on this machine train one model, and the demo kills,
deletes and brings back nodes while it narrates what the group does.

A local etcd on free ports; three fsdp-agents (--nnodes 2:3, one fsdp-trainer worker
each, addresses 127.0.0.1-3) sharing one checkpoint directory. Mid-training it SIGKILLs
node 2 (a node dies), brings it back, SIGTERMs node 1 (a pod delete) and brings it back.
Each event is one line with the figures a user cares about; at the end a table, the loss
curve, one `fsdp-agent status` taken mid-run, and where the logs are. Every process and
the etcd it started are stopped on the way out, also on Ctrl-C.

usage: elastic.py --agent BIN --trainer BIN [--steps N] [--workdir DIR]
Standard library only.
"""
import argparse
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

POLL = 0.05
AGENT_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")
BATCH = re.compile(r"Batch (\d+) Loss: ([0-9.]+)")
LOADED = re.compile(r"(Loaded checkpoint \S+ \(step|Restored step) (\d+)")
STARTED = re.compile(r"workers started")
SAVED = re.compile(r"Saved checkpoint \S+ \(step (\d+)")
FORMED = re.compile(r"group formed .*round=(\d+) world_size=(\d+)")


def say(msg):
    print(f"[demo] {msg}", flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stamp(line):
    """The agent's own timestamp of a log line, as Unix seconds."""
    m = AGENT_TS.match(line)
    if not m:
        return None
    return datetime.strptime(m.group(1)[:26], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()


class Node:
    """One agent process (a "pod") and the files its output goes to."""

    def __init__(self, demo, index):
        self.demo, self.index, self.proc, self.incarnation = demo, index, None, 0

    def start(self):
        d = self.demo
        self.incarnation += 1
        tag = f"node{self.index}.{self.incarnation}"
        self.out = os.path.join(d.workdir, f"{tag}.out")
        self.err = os.path.join(d.workdir, f"{tag}.err")
        argv = [
            d.agent, "--nnodes", "2:3", "--nproc-per-node", "1",
            "--rdzv-backend", "etcd", "--rdzv-endpoint", d.endpoint, "--rdzv-id", d.run_id,
            "--rdzv-conf", "last_call_timeout=2,keep_alive_ttl=5",
            "--local-addr", f"127.0.0.{self.index + 1}", "--status-addr", "127.0.0.1:0",
            "--max-restarts", "10", "--term-timeout", "5",
            "--log-dir", os.path.join(d.workdir, "logs", tag),
            "--no-python", d.trainer,
            "--max_steps", str(d.steps), "--logging_freq", "5",
            "--checkpoint_freq", str(d.ckpt_every), "--threads", "1",
            # Big enough to watch (about 15 steps a second on two cores), small enough
            # for any machine.
            "--hidden_width", "128", "--num_layers", "4", "--intermediate_size", "344",
            "--num_heads", "8", "--num_key_value_heads", "4", "--max_context_width", "64",
            "--checkpoint_dir", d.ckpt, "--resume_from_checkpoint", d.ckpt,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(self.out, "w") as out, open(self.err, "w") as err:
            # Its own session: a SIGKILL of the "pod" is a SIGKILL of the agent, whose
            # workers die with it (they carry the agent's parent-death signal).
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        self.started_at = time.time()

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig):
        if self.alive():
            os.kill(self.proc.pid, sig)

    def lines(self, which="err"):
        try:
            with open(self.err if which == "err" else self.out) as f:
                return f.read().splitlines()
        except OSError:
            return []


class Demo:
    def __init__(self, args):
        self.agent, self.trainer, self.steps = args.agent, args.trainer, args.steps
        self.ckpt_every = max(5, args.steps // 32 // 5 * 5)
        self.workdir = args.workdir or tempfile.mkdtemp(prefix="fsdp-demo-")
        os.makedirs(self.workdir, exist_ok=True)
        self.ckpt = os.path.join(self.workdir, "checkpoints")
        self.run_id = f"demo-{os.getpid()}"
        self.etcd = None
        self.nodes = [Node(self, i) for i in range(3)]
        self.events = []
        self.status_shown = False

    # --- etcd -----------------------------------------------------------------------
    def start_etcd(self):
        client, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{client}"
        data = os.path.join(self.workdir, "etcd")
        log = open(os.path.join(self.workdir, "etcd.log"), "w")
        self.etcd = subprocess.Popen(
            ["etcd", "--name", "demo", "--data-dir", data,
             "--listen-client-urls", f"http://{self.endpoint}",
             "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"demo=http://127.0.0.1:{peer}", "--log-level", "warn"],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        end = time.time() + 20
        while time.time() < end:
            try:
                socket.create_connection(("127.0.0.1", client), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit("etcd did not start; see " + os.path.join(self.workdir, "etcd.log"))

    # --- what the nodes said --------------------------------------------------------
    def outputs(self):
        """{path: lines} of every agent's stdout (its workers' output)."""
        out = {}
        for n in self.nodes:
            for inc in range(1, n.incarnation + 1):
                path = os.path.join(self.workdir, f"node{n.index}.{inc}.out")
                try:
                    with open(path) as f:
                        out[path] = f.read().splitlines()
                except OSError:
                    pass
        return out

    def trainer_lines(self):
        return [l for lines in self.outputs().values() for l in lines]

    def snapshot(self):
        """How many lines each output has now: what comes later is news."""
        return {path: len(lines) for path, lines in self.outputs().items()}

    def resumed_since(self, snap):
        """(step, trained, source): the step rank 0 resumed at after `snap`, whether it
        logged a step after that, and where the state came from ("peer memory" or "the
        checkpoint"); None before it resumed."""
        for path, lines in self.outputs().items():
            new = lines[snap.get(path, 0):]
            for i, l in enumerate(new):
                m = LOADED.search(l)
                if m:
                    trained = any(BATCH.search(x) for x in new[i + 1:])
                    source = "peer memory" if m.group(1).startswith("Restored") else "the checkpoint"
                    return int(m.group(2)), trained, source
        return None

    def restarted(self, node, after):
        """Whether `node`'s agent started new workers after `after` (not: its workers
        re-formed in place, the same processes)."""
        return any(STARTED.search(l) and (stamp(l) or 0) > after for l in node.lines())

    def step(self):
        """The furthest step any rank 0 logged."""
        steps = [int(m.group(1)) + 1 for l in self.trainer_lines() for m in [BATCH.search(l)] if m]
        return max(steps, default=0)

    def checkpoints(self):
        return sorted({int(m.group(1)) for l in self.trainer_lines() for m in [SAVED.search(l)] if m})

    def formed(self, node, after):
        """(time, world) of the first 'group formed' of `node` logged after `after`."""
        for l in node.lines():
            m = FORMED.search(l)
            t = stamp(l)
            if m and t and t > after:
                return t, int(m.group(2))
        return None

    def wait(self, what, cond, limit=120):
        end = time.time() + limit
        while time.time() < end:
            v = cond()
            if v:
                return v
            for n in self.nodes:
                if n.proc is not None and n.proc.poll() not in (None, 0) and n.expected_alive:
                    raise SystemExit(f"node {n.index} exited {n.proc.returncode} while {what}; see {n.err}")
            time.sleep(POLL)
        raise SystemExit(f"timed out after {limit}s while {what}; logs in {self.workdir}")

    # --- events ---------------------------------------------------------------------
    def until_step(self, s):
        self.wait(f"waiting for step {s}", lambda: self.step() >= s)

    def reform(self, label, cause, survivors, world_from, world_to, t0, at_step, snap):
        formed = self.wait(
            f"waiting for the group to re-form after {label}",
            lambda: all(self.formed(self.nodes[i], t0) for i in survivors) and
            [self.formed(self.nodes[i], t0)[1] for i in survivors] == [world_to] * len(survivors))
        took = max(self.formed(self.nodes[i], t0)[0] for i in survivors) - t0
        resumed, _, source = self.wait("waiting for training to resume", lambda: self.resumed_since(snap))
        self.wait("waiting for the first step after the resume",
                  lambda: self.resumed_since(snap)[1] or None)
        training = time.time() - t0
        lost = max(0, at_step - resumed)
        nodes = ", ".join(f"{i}" for i in survivors)
        kept = [i for i in survivors if self.nodes[i].started_at < t0 and not self.restarted(self.nodes[i], t0)]
        processes = (f"; nodes {', '.join(map(str, kept))} kept their worker processes" if kept
                     else "")
        where = (f"resumed from peer memory at step {resumed}" if source == "peer memory"
                 else f"resumed from the checkpoint of step {resumed}")
        say(f"{cause} at step {at_step} → nodes {nodes} re-formed in {took:.2f} s "
            f"(world {world_from} → {world_to}), {where}, "
            f"training again {training:.1f} s after the event ({lost} steps redone){processes}")
        self.events.append((label, at_step, took, training, f"{world_from} → {world_to}", resumed, lost))
        del formed

    def lose(self, i, sig, label, cause):
        """Node `i` gets `sig`; the others must re-form without it."""
        at = self.step()
        snap = self.snapshot()
        t0 = time.time()
        self.nodes[i].expected_alive = False
        self.nodes[i].signal(sig)
        survivors = [n.index for n in self.nodes if n.index != i and n.expected_alive]
        self.reform(label, cause, survivors, 3, 2, t0, at, snap)

    def kill(self, i):
        self.lose(i, signal.SIGKILL, f"node {i} killed", f"killed node {i} (SIGKILL)")

    def delete(self, i):
        self.lose(i, signal.SIGTERM, f"node {i} deleted", f"deleted node {i} (SIGTERM, as a pod delete)")
        code = self.nodes[i].proc.wait(timeout=30)
        say(f"node {i}'s agent exited {code} (a pod stopped from outside, not a failure)")

    def back(self, i):
        at = self.step()
        snap = self.snapshot()
        t0 = time.time()
        self.nodes[i].expected_alive = True
        self.nodes[i].start()
        everyone = [n.index for n in self.nodes]
        self.reform(f"node {i} back", f"node {i} back (a new agent)", everyone, 2, 3, t0, at, snap)

    def show_status(self):
        out = subprocess.run([self.agent, "status", "--rdzv-endpoint", self.endpoint,
                              "--rdzv-id", self.run_id], capture_output=True, text=True, timeout=30)
        say("fsdp-agent status, taken now:")
        for l in out.stdout.splitlines():
            print(f"    {l}")

    # --- the whole story --------------------------------------------------------------
    def run(self):
        say(f"work directory {self.workdir}")
        self.start_etcd()
        say(f"etcd at {self.endpoint}; run id {self.run_id}; {self.steps} steps, "
            f"a checkpoint every {self.ckpt_every}")
        for n in self.nodes:
            n.expected_alive = True
            n.start()
        say("started 3 agents (--nnodes 2:3, one fsdp-trainer worker each)")
        t0 = min(n.started_at for n in self.nodes)
        self.wait("waiting for the first round",
                  lambda: all((self.formed(n, 0) or (0, 0))[1] == 3 for n in self.nodes))
        took = max(self.formed(n, 0)[0] for n in self.nodes) - t0
        say(f"group of 3 formed {took:.2f} s after the agents started")
        s = self.steps
        self.until_step(s * 20 // 100)
        self.kill(2)
        self.until_step(s * 35 // 100)
        self.back(2)
        self.until_step(s * 45 // 100)
        self.show_status()
        self.until_step(s * 60 // 100)
        self.delete(1)
        self.until_step(s * 75 // 100)
        self.back(1)
        codes = self.wait("waiting for training to finish",
                          lambda: all(not n.alive() for n in self.nodes if n.expected_alive) or None,
                          limit=600)
        del codes
        codes = {n.index: n.proc.returncode for n in self.nodes}
        finished = next((l for l in self.trainer_lines() if "Training finished" in l), None)
        if finished:
            say(finished.split("]:", 1)[-1].strip())
        self.summary()
        bad = {i: c for i, c in codes.items() if c != 0}
        if bad:
            raise SystemExit(f"agents exited {bad}; logs in {self.workdir}")
        say(f"every agent exited 0; logs in {self.workdir}")

    def summary(self):
        print()
        print(f"{'event':<16} {'at step':>7} {'re-formed in':>12} {'training again':>14} "
              f"{'world':>7} {'resumed from':>12} {'steps redone':>12}")
        for label, at, took, training, world, resumed, lost in self.events:
            print(f"{label:<16} {at:>7} {took:>11.2f}s {training:>13.1f}s {world:>7} "
                  f"{resumed:>12} {lost:>12}")
        print()
        curve = {}
        for l in self.trainer_lines():
            m = BATCH.search(l)
            if m:
                curve[int(m.group(1)) + 1] = float(m.group(2))
        plot(curve, [e[1] for e in self.events])

    def cleanup(self):
        # As a pod delete would: SIGTERM (the agents stop their workers), then SIGKILL.
        for n in self.nodes:
            n.signal(signal.SIGTERM)
        end = time.time() + 10
        for n in self.nodes:
            if n.proc is None:
                continue
            try:
                n.proc.wait(timeout=max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(n.proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                n.proc.wait()
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.terminate()
            try:
                self.etcd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.etcd.kill()
                self.etcd.wait()
        shutil.rmtree(os.path.join(self.workdir, "etcd"), ignore_errors=True)


def plot(curve, marks, width=60, height=10):
    """The loss against the step, as text; `|` marks the events."""
    if not curve:
        return
    steps = sorted(curve)
    # A log scale: the first steps' fall would flatten the rest.
    curve = {s: math.log(max(v, 1e-9)) for s, v in curve.items()}
    lo, hi = min(curve.values()), max(curve.values())
    span = (hi - lo) or 1.0
    first, last = steps[0], steps[-1]
    cols = [None] * width
    for s in steps:
        c = min(width - 1, (s - first) * (width - 1) // max(1, last - first))
        cols[c] = curve[s]
    rows = [[" "] * width for _ in range(height)]
    for c, v in enumerate(cols):
        if v is not None:
            r = int((hi - v) / span * (height - 1))
            rows[r][c] = "*"
    for m in marks:
        c = min(width - 1, max(0, (m - first) * (width - 1) // max(1, last - first)))
        for r in rows:
            if r[c] == " ":
                r[c] = "|"
    print(f"loss by step, log scale (| marks an event): {math.exp(hi):.3f} at the top, "
          f"{math.exp(lo):.3f} at the bottom")
    for r in rows:
        print("    " + "".join(r))
    print(f"    step {first}{' ' * (width - len(str(first)) - len(str(last)) - 5)}{last}")
    print()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agent", required=True)
    p.add_argument("--trainer", required=True)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--workdir")
    args = p.parse_args()
    demo = Demo(args)

    def stop(sig, _frame):
        say(f"{signal.Signals(sig).name}: stopping every agent and etcd")
        demo.cleanup()
        sys.exit(128 + sig)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        demo.run()
    finally:
        demo.cleanup()


if __name__ == "__main__":
    main()
