"""A job run half under torchrun (issue 32): how soon fsdp-agent gives up with its one line
(`the other node runs torchrun; run the same launcher on every node`, exit 64) when the
other node of a two-node job runs torchrun. As tests/tests/compat.rs's
`a_mixed_job_fails_with_one_line`: the first launcher starts, 3 s later the second (the
first hosts node 0's store, static, or serves the c10d store), and the clock runs from the
second's start to fsdp-agent's exit. Also: how long `import torch` takes here, which
torchrun pays before it says anything.

Cases:
  static-torchrun-0   static rendezvous, torchrun on node 0 (started first)
  static-torchrun-1   static rendezvous, torchrun on node 1
  c10d-torchrun-host  c10d, torchrun serves the store (started first)
  c10d-agent-host     c10d, fsdp-agent serves the store

usage: python bench/mixed.py [--agent target/release/fsdp-agent] [--cases ...] [--import-runs 3]
                            [--json FILE]
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from elastic import free_port  # noqa: E402
from hangs import descendants  # noqa: E402

CASES = {"static-torchrun-0": ("static", True), "static-torchrun-1": ("static", False),
         "c10d-torchrun-host": ("c10d", True), "c10d-agent-host": ("c10d", False)}
TRAIN = "import torch.distributed as dist\ndist.init_process_group('gloo')\nprint('formed', flush=True)\n"
LINE = "the other node runs torchrun; run the same launcher on every node"
WAIT = 3  # seconds between the first launcher and the second


def clean_env():
    """Nothing of this environment (as the test's): the venv first on PATH, no status port."""
    return {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
            "FSDP_STATUS_ADDR": "off", "TMPDIR": os.environ.get("TMPDIR", "/tmp")}


def case(agent, backend, torchrun_first, limit):
    d = tempfile.mkdtemp(prefix="bench-mixed-")
    with open(os.path.join(d, "train.py"), "w") as f:
        f.write(TRAIN)
    port = str(free_port())
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")

    def node(program, rank):
        cmd = [program, "--nnodes", "2", "--nproc-per-node", "1"]
        if backend == "static":
            cmd += ["--node-rank", rank, "--master-addr", "127.0.0.1", "--master-port", port]
        else:
            cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "mixed",
                    "--local-addr", "127.0.0.1"]
        err = open(os.path.join(d, f"{os.path.basename(program)}.err"), "w+")
        return subprocess.Popen(cmd + ["train.py"], cwd=d, env=clean_env(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err), err

    first, second = (torchrun, agent) if torchrun_first else (agent, torchrun)
    procs = [node(first, "0")]
    time.sleep(WAIT)
    procs.append(node(second, "1"))
    started = time.monotonic()
    (a, a_err), (t, _) = (procs[1], procs[0]) if torchrun_first else (procs[0], procs[1])
    try:
        code = a.wait(timeout=limit)
        took = time.monotonic() - started
    except subprocess.TimeoutExpired:
        code, took = None, None
    # torchrun's worker outlives a SIGKILLed torchrun: everything below both launchers goes.
    for p, _ in procs:
        for pid in descendants(p.pid) + [p.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()
    a_err.seek(0)
    said = LINE in a_err.read()
    for _, err in procs:
        err.close()
    shutil.rmtree(d, ignore_errors=True)
    return {"backend": backend, "torchrun_first": torchrun_first, "seconds": took, "exit": code, "said": said}


def import_torch(runs):
    if not runs:
        return None
    xs = []
    for _ in range(runs):
        t = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        xs.append(time.monotonic() - t)
    return statistics.median(xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", default=os.path.join(os.path.dirname(HERE), "target/release/fsdp-agent"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--limit", type=float, default=60)
    ap.add_argument("--import-runs", dest="import_runs", type=int, default=3,
                    help="times `import torch` is timed (0: not timed)")
    ap.add_argument("--json", help="also write the figures here as JSON")
    a = ap.parse_args()
    out = {"wait_s": WAIT, "limit_s": a.limit, "cases": {}}
    for name in a.cases.split(","):
        r = case(a.agent, *CASES[name], a.limit)
        out["cases"][name] = r
        shown = f"{r['seconds']:.2f} s" if r["seconds"] is not None else f"not within {a.limit:.0f} s"
        print(f"{name}: fsdp-agent exited {r['exit']} {shown} after the second node started; "
              f"said it: {r['said']}", flush=True)
    out["import_torch_s"] = import_torch(a.import_runs)
    if out["import_torch_s"] is not None:
        print(f"import torch: {out['import_torch_s']:.2f} s (median of {a.import_runs})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
