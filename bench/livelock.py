#!/usr/bin/env python3
"""Livelock figures (issue 26): the frozen-agent command outside testing found, run N times.

A one-node etcd job, lease TTL 3 s; the first attempt's worker freezes its own agent for
8 s (SIGSTOP, then SIGCONT) as a node swapping hard or a VM pause would. Before the fix the
agent sealed ~600 rounds a second after the thaw and never exited (4 runs in 5). Printed
per run: exit code, seconds, rounds sealed (the agent's "round sealed" lines), worker starts
and their TORCHELASTIC_RESTART_COUNT, etcd revisions used, and whether the coordinator's
safety net ("too fast") had to hold a round.

--freeze sets how long the agent is frozen (8 s) and --work how long the restarted worker
then runs (20 s); --json also writes the runs there (bench/suite.py reads them).

usage: python bench/livelock.py [--agent target/debug/fsdp-agent] [--runs 3] [--limit 60]
                                [--freeze 8] [--work 20] [--json FILE]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from elastic import Etcd  # noqa: E402

TTL = 3  # the lease TTL (s): the freeze must outlast it

# The first attempt outlasts the freeze (its agent's thaw ends it); the restarted one runs
# WORK seconds.
WORKER = ("echo start restart=$TORCHELASTIC_RESTART_COUNT; if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then "
          "sleep 2; P=$PPID; kill -STOP $P; (sleep {freeze}; kill -CONT $P) & exec sleep {first}; fi; "
          "exec sleep {work}")


def revision(port):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v3/kv/range", data=json.dumps({"key": "AA=="}).encode())
    with urllib.request.urlopen(req, timeout=5) as r:
        return int(json.load(r)["header"]["revision"])


def run(agent, etcd, n, limit, freeze, work):
    argv = [agent, "--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{etcd.port}",
            "--rdzv-conf", f"keep_alive_ttl={TTL},straggler_timeout=10", "--rdzv-id", f"stoploop-{n}-{time.time_ns()}",
            "--max-restarts", "1", "--term-timeout", "2", "--no-python", "/bin/sh", "-c",
            WORKER.format(freeze=freeze, first=freeze + work, work=work)]
    env = dict(os.environ, RUST_LOG="info", FSDP_STATUS_ADDR="127.0.0.1:0")
    rev0 = revision(etcd.port)
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            code = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            code = None
        secs = time.monotonic() - t0
        out.seek(0)
        text = out.read()
    return {
        "exit": code,
        "seconds": round(secs, 1),
        "rounds_sealed": text.count("round sealed"),
        "starts": [l.split("=", 1)[1] for l in text.splitlines() if l.startswith("start restart=")],
        "etcd_revisions": revision(etcd.port) - rev0,
        "held": "too fast" in text,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", default=os.path.join(ROOT, "target/debug/fsdp-agent"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--limit", type=float, default=60)
    ap.add_argument("--freeze", type=float, default=8, help="seconds the first worker freezes its agent")
    ap.add_argument("--work", type=float, default=20, help="seconds the restarted worker runs")
    ap.add_argument("--json", help="also write the runs here as JSON")
    a = ap.parse_args()
    etcd = Etcd(v2=False)
    try:
        results = []
        for n in range(a.runs):
            r = run(a.agent, etcd, n, a.limit, a.freeze, a.work)
            results.append(r)
            print(f"run {n}: exit={r['exit']} seconds={r['seconds']} rounds_sealed={r['rounds_sealed']} "
                  f"starts={','.join(r['starts'])} etcd_revisions={r['etcd_revisions']} held={r['held']}", flush=True)
        ok = sum(1 for r in results if r["exit"] == 0 and r["starts"] == ["0", "1"] and r["rounds_sealed"] <= 5)
        print(f"livelock: {ok} of {len(results)} runs exit 0 with the worker restarted once and at most 5 rounds sealed; "
              f"rounds sealed max {max(r['rounds_sealed'] for r in results)}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"freeze_s": a.freeze, "work_s": a.work, "limit_s": a.limit, "ttl_s": TTL, "ok": ok,
                           "runs": results}, f, indent=1)
    finally:
        etcd.stop()


if __name__ == "__main__":
    main()
