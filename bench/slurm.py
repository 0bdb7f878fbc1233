"""Slurm benchmark: a node killed under `srun --no-kill`, fsdp-agent and torchrun side by side.

On the real test cluster of scripts/slurm (three slurmd, nodes n1..n3 in their own UTS and
mount namespaces on this machine), each run is one step
`srun -N3 --no-kill LAUNCHER --nnodes 2:3 ... tests/py/elastic_worker.py CKPT STEPS`:
when the checkpoint passes step 20, `scripts/slurm/kill-node.sh n3` kills the node
(slurmd, step daemon, agent and workers at once). Printed per run: the node's death to the
group of two's first all-reduce (the workers' own `allreduced ... world=2 t=` line, wall
clock) and the step's exit code; and the step's start (srun started) to the group of three's
first all-reduce (every node's `allreduced ... world=3` line).

Launchers:
  fsdp-agent   no rendezvous flags (Slurm gives the c10d endpoint, the job ID, the nodes)
  fsdp-agent-prewarm  the same with --prewarm (a spare interpreter per rank, torch imported)
  torchrun     --rdzv-backend c10d --rdzv-endpoint n1:29400 --rdzv-id $SLURM_JOB_ID;
               is_host on node 0 only (the nodes share the loopback, so every torchrun
               would otherwise take itself for the host)

usage: python bench/slurm.py [--runs 3] [--agent target/release/fsdp-agent]
       [--kinds fsdp-agent,torchrun] [--limit 120] [--steps 300] [--port P] [--json FILE]
--port gives both launchers the c10d port P on n1 (29400, torchrun's, by default: the
agent takes it from Slurm); another cluster's jobs on this machine (the tests') may hold
29400. The cluster's own state directory and ports come from FSDP_SLURM_DIR and
FSDP_SLURM_PORT (scripts/slurm/common.sh). --json also writes the runs there.
Needs root and scripts/setup.sh's Slurm packages.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests/py/elastic_worker.py")


def script(name, *args):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts/slurm", name), *args],
                          capture_output=True, text=True)


def start_cluster():
    out = script("start.sh")
    if out.returncode != 0:
        sys.exit(f"scripts/slurm/start.sh failed:\n{out.stdout}\n{out.stderr}")
    for line in out.stdout.splitlines():
        if line.startswith("export SLURM_CONF="):
            return line.split("=", 1)[1].strip()
    sys.exit(f"start.sh printed no SLURM_CONF:\n{out.stdout}")


def launcher(kind, agent, port):
    # The agent finds the endpoint (n1, port 29400) in Slurm's variables; only another
    # port is given.
    endpoint = f" --rdzv-endpoint n1:{port}" if port else ""
    if kind == "fsdp-agent":
        return f"{agent} --nnodes 2:3 --max-restarts 3{endpoint}"
    if kind == "fsdp-agent-prewarm":
        return f"{agent} --nnodes 2:3 --max-restarts 3 --prewarm{endpoint}"
    host = '$([ "$SLURM_NODEID" = 0 ] && echo 1 || echo 0)'
    return (f"{sys.executable} -m torch.distributed.run --nnodes 2:3 --nproc-per-node 1 "
            f"--max-restarts 3 --rdzv-backend c10d --rdzv-endpoint n1:{port or 29400} "
            f"--rdzv-id $SLURM_JOB_ID --rdzv-conf is_host={host}")


def progress(ckpt):
    try:
        with open(os.path.join(ckpt, "step")) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def one_run(kind, a, conf):
    tmp = tempfile.mkdtemp(prefix="fsdp-bench-slurm-")
    ckpt = os.path.join(tmp, "ckpt")
    os.mkdir(ckpt)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env.update(SLURM_CONF=conf, TMPDIR=tmp, GLOO_SOCKET_IFNAME="lo", RUST_LOG="info",
               PATH=os.path.dirname(sys.executable) + ":" + env.get("PATH", ""))
    line = f"{launcher(kind, a.agent, a.port)} {WORKER} {ckpt} {a.steps}"
    out_path = os.path.join(tmp, "out")
    started = time.time()
    with open(out_path, "w") as out:
        step = subprocess.Popen(["srun", "-N3", "--no-kill", "-J", f"bench-{kind}",
                                 "bash", "-c", line], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + a.limit
    while progress(ckpt) < 20 and step.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    kill_started = time.time()
    script("kill-node.sh", "n3")
    killed_at = time.time()
    try:
        code = step.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(step.pid, signal.SIGKILL)
        step.wait()
        code = "killed at the limit"
    with open(out_path, errors="replace") as f:
        lines = [l for l in f if "allreduced " in l and " t=" in l]
    at = lambda l: float(l.split(" t=")[1].split()[0])
    again = [at(l) for l in lines if " world=2 " in l]
    first = min((t for t in again if t >= kill_started), default=None)
    # The group of three: each node's first all-reduce, the last of them.
    three = {}
    for l in lines:
        if " world=3 " in l:
            host = l.split("host=")[1].split()[0]
            three[host] = min(three.get(host, at(l)), at(l))
    formed = max(three.values()) - started if len(three) == 3 else None
    shutil.rmtree(tmp, ignore_errors=True)
    if first is None:
        return None, code, formed
    return (first - killed_at, first - kill_started), code, formed


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--agent", default=os.path.join(ROOT, "target/release/fsdp-agent"))
    p.add_argument("--kinds", default="fsdp-agent,fsdp-agent-prewarm,torchrun")
    p.add_argument("--limit", type=float, default=120.0)
    p.add_argument("--steps", type=int, default=300, help="the job's steps (the kill comes after step 20)")
    p.add_argument("--port", type=int, help="the c10d port on n1 (default: 29400, from Slurm)")
    p.add_argument("--json", help="also write the runs here as JSON")
    a = p.parse_args()
    runs = []
    print(f"# node n3 killed under srun -N3 --no-kill, --nnodes 2:3, {a.runs} run(s) each")
    print("# death to the group of two's first all-reduce: from kill-node.sh's end to its")
    print("# start (the node dies in between)")
    print("| launcher | death to the group of two's first all-reduce | step exit |")
    print("|---|---|---|")
    try:
        for kind in a.kinds.split(","):
            for _ in range(a.runs):
                conf = start_cluster()
                took, code, formed = one_run(kind, a, conf)
                script("stop.sh")
                runs.append({"kind": kind, "death_to_allreduce_s": took, "exit": code, "start_to_allreduce_s": formed})
                shown = (f"{took[0]:.2f}-{took[1]:.2f} s" if took is not None
                         else f"never (within {a.limit:.0f} s)")
                print(f"| {kind} | {shown} | {code} |", flush=True)
    finally:
        script("stop.sh")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": a.runs, "limit_s": a.limit, "steps": a.steps, "results": runs}, f, indent=1)


if __name__ == "__main__":
    main()
