#!/usr/bin/env python3
"""Hang figures (issue 16), fsdp-agent beside torchrun, same worker, same machine.

1. stall → running again: tests/py/hang_worker.py, 2 gloo ranks, steps of 0.2 s; on the
   first attempt rank 1 stalls after step 10 (after its all-reduce, before it reports, as a
   rank stuck in I/O). fsdp-agent: automatic timeout with --hang-min 2; torchrun: the same
   script and --max-restarts 1 (it has no hang detection; the group waits for gloo's
   collective timeout, 30 min by default). The clock runs from the stall (printed by the
   stalled rank) to the last restarted rank's start line.
2. the cost of progress reports: 2 workers each reporting 1,000 steps/s for 10 s (a busy
   loop that sends one datagram per step; --seconds); the agent's CPU time and peak RSS,
   and the steps/s the workers reach, with reports on and with --hang-timeout off (no
   socket: the helper sends nothing).

usage: python bench/hangs.py [--agent target/release/fsdp-agent] [--timeout 90] [--seconds 10]
                             [--kinds fsdp-agent,torchrun] [--json FILE]
--json also writes the figures there (bench/suite.py reads them).
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG = os.path.join(ROOT, "tests/py/hang_worker.py")

BUSY = """
import os, sys, time
sys.path.insert(0, %r)
from progress import step
end, n = time.time() + %s, 0
next_t = time.time()
while time.time() < end:
    n += 1
    step(n)
    next_t += 0.001
    while time.time() < next_t:
        pass
print(f"steps rank={os.environ['RANK']} n={n}", flush=True)
"""


# The automatic timeout's floor (s): the stalled group is called hung once this and 10
# steps' time have passed without progress.
HANG_MIN = 2


def env():
    e = dict(os.environ, LOGLEVEL="WARNING", RUST_LOG="info", FSDP_STATUS_ADDR="127.0.0.1:0",
             PATH=os.path.dirname(sys.executable) + ":" + os.environ["PATH"], PYTHON=sys.executable)
    return e


def descendants(pid):
    """Every process below pid, from /proc (a launcher's workers, their children)."""
    kids = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def stall(kind, agent, timeout):
    d = tempfile.mkdtemp(prefix="bench-hang-")
    ckpt = os.path.join(d, "ckpt")
    os.makedirs(ckpt)
    worker = [HANG, ckpt, "40", "10", "1"]
    if kind == "fsdp-agent":
        argv = [agent, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--hang-min",
                str(HANG_MIN)] + worker
    else:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        argv = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"] + worker
    out = open(os.path.join(d, "out"), "w+")
    p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env(), cwd=d)

    def measured():
        with open(out.name, errors="replace") as f:
            text = f.read()
        stalled = [float(t) for t in re.findall(r"stall rank=\d+ step=\d+ t=([\d.]+)", text)]
        again = [float(t) for t in re.findall(r"start rank=\d+ step=\d+ restart=1 t=([\d.]+)", text)]
        return max(again) - stalled[0] if stalled and len(again) >= 2 else None

    # Until both ranks run again (the rest of the training is not timed), the launcher
    # ends, or the timeout.
    end = time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < end and measured() is None:
        time.sleep(0.1)
    # torchrun's workers outlive a SIGKILLed torchrun (the stalled group would hold on for
    # gloo's 30 minutes): everything below the launcher goes with it.
    for pid in descendants(p.pid) + [p.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()
    took = measured()
    out.close()
    shutil.rmtree(d, ignore_errors=True)
    return took


def agent_cpu(agent, reports, seconds):
    """The agent's own CPU time and peak RSS (its workers excluded), from /proc while it runs."""
    d = tempfile.mkdtemp(prefix="bench-cost-")
    script = os.path.join(d, "busy.py")
    with open(script, "w") as f:
        f.write(BUSY % (os.path.join(ROOT, "examples"), seconds))
    argv = [agent, "--standalone", "--nproc-per-node", "2", "--hang-timeout", "auto" if reports else "off", script]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env(), text=True, cwd=d)
    tick = os.sysconf("SC_CLK_TCK")
    cpu, rss = 0.0, 0
    while p.poll() is None:
        try:
            stat = open(f"/proc/{p.pid}/stat").read().split()
            cpu = (int(stat[13]) + int(stat[14])) / tick
            for line in open(f"/proc/{p.pid}/status"):
                if line.startswith("VmHWM:"):
                    rss = int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError):
            pass
        time.sleep(0.05)
    out = p.stdout.read()
    shutil.rmtree(d, ignore_errors=True)
    steps = sum(int(n) for n in re.findall(r"steps rank=\d+ n=(\d+)", out))
    return cpu, rss / 1024, steps / seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", default=os.path.join(ROOT, "target/release/fsdp-agent"))
    ap.add_argument("--timeout", type=float, default=90)
    ap.add_argument("--seconds", type=float, default=10, help="how long the cost measurement's workers run")
    ap.add_argument("--kinds", default="fsdp-agent,torchrun", help="the launchers of the stall measurement (none: '')")
    ap.add_argument("--json", help="also write the figures here as JSON")
    a = ap.parse_args()
    print(f"machine: {os.cpu_count()} cpus")
    out = {"timeout_s": a.timeout, "seconds": a.seconds, "hang_min_s": HANG_MIN, "stall_s": {}, "cost": {}}
    for kind in filter(None, a.kinds.split(",")):
        s = stall(kind, a.agent, a.timeout)
        out["stall_s"][kind] = s
        print(f"stall->running-again {kind}: " + (f"{s:.2f} s" if s is not None else f"not within {a.timeout:.0f} s"),
              flush=True)
    for reports in (True, False):
        cpu, rss, rate = agent_cpu(a.agent, reports, a.seconds)
        out["cost"]["on" if reports else "off"] = {"agent_cpu_s": cpu, "agent_rss_mib": rss, "steps_per_s": rate}
        print(f"reports={'on' if reports else 'off'}: agent cpu {cpu:.2f} s over {a.seconds:g} s, peak rss "
              f"{rss:.1f} MiB, workers {rate:.0f} steps/s in all", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
