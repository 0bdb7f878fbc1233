"""The benchmark suite: every figure of fsdp-agent's claim, measured side by side with
torchrun (same PyTorch 2.13 venv) in one run on this machine, and docs/benchmarks.md
regenerated from the results with tables and SVG plots.

usage: scripts/bench.sh            (builds release binaries, then runs this)
       python bench/suite.py [--out docs] [--runs 5] [--tiny]

--tiny runs every benchmark at the smallest size once (the smoke test uses it); it writes
its report where --out says, never over docs/ unless told to.
"""
import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import svg  # noqa: E402
from elastic import Etcd  # noqa: E402  (the same etcd the multi-node benchmark starts)

PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
# fsdp-agent runs as deployed, status server included (on a free port).
QUIET = dict(os.environ, LOGLEVEL="WARNING", RUST_LOG="warn", FSDP_STATUS_ADDR="127.0.0.1:0")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stats(xs):
    ok = [x for x in xs if x is not None]
    if not ok:
        return None
    return {"median": statistics.median(ok), "min": min(ok), "max": max(ok), "n": len(ok), "failed": len(xs) - len(ok)}


def cell(s, fmt="{:.2f}"):
    if s is None:
        return "never"
    text = f"{fmt.format(s['median'])} [{fmt.format(s['min'])}–{fmt.format(s['max'])}]"
    return text + (f" ({s['failed']} of {s['n'] + s['failed']} never)" if s["failed"] else "")


def ratio(theirs, ours):
    if theirs is None or ours is None or ours["median"] == 0:
        return "–"
    return f"{theirs['median'] / ours['median']:.1f}x"


def launcher(kind, agent):
    return [agent] if kind == "fsdp-agent" else [TORCHRUN]


def wait4(cmd, env=QUIET, watch_hwm=False):
    """Runs cmd; returns wall seconds and its rusage. With watch_hwm, rusage gets a
    `hwm_kib` attribute: the launcher's own VmHWM, read from /proc while it runs (wait4's
    ru_maxrss would count the forked Python's pages before exec)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    hwm = 0
    while watch_hwm:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                line = next((l for l in f if l.startswith("VmHWM:")), None)
            if line is None:
                break  # a zombie: it has exited
            hwm = max(hwm, int(line.split()[1]))
        except OSError:
            break
        if os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            break
        time.sleep(0.05)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd} exited {p.returncode}")
    return wall, (ru, hwm)


def bench_launch(a):
    """1. --standalone --nproc-per-node N --no-python /bin/true: exec to exit."""
    out = {}
    for nproc in a.nprocs:
        for kind in ("fsdp-agent", "torchrun"):
            cmd = launcher(kind, a.agent) + ["--standalone", "--nproc-per-node", str(nproc), "--no-python", "/bin/true"]
            wait4(cmd)  # warm the page cache
            walls = [wait4(cmd)[0] * 1000 for _ in range(a.runs)]
            out[f"{kind}/{nproc}"] = stats(walls)
            log(f"launch nproc={nproc} {kind}: {cell(out[f'{kind}/{nproc}'], '{:.1f}')} ms")
    return out


def bench_idle(a):
    """2. Launcher peak RSS and CPU time while 8 idle workers run for a while."""
    out = {}
    for kind in ("fsdp-agent", "torchrun"):
        rss, cpu = [], []
        for _ in range(a.runs_slow):
            cmd = launcher(kind, a.agent) + ["--standalone", "--nproc-per-node", str(a.idle_workers), "--no-python",
                                             "/bin/sleep", str(a.idle_seconds)]
            _, (ru, hwm) = wait4(cmd, watch_hwm=True)
            rss.append(hwm / 1024)
            cpu.append((ru.ru_utime + ru.ru_stime) * 1000)
        out[kind] = {"rss_mib": stats(rss), "cpu_ms": stats(cpu)}
        log(f"idle {kind}: rss {cell(out[kind]['rss_mib'], '{:.1f}')} MiB, cpu {cell(out[kind]['cpu_ms'], '{:.0f}')} ms")
    return out


def bench_elastic(a):
    """3-5. Multi-node start, re-form after SIGKILL/SIGTERM, scale-up (bench/elastic.py)."""
    out = {}
    for scenarios, runs in a.elastic_plan:
        path = tempfile.mktemp(suffix=".json")
        cmd = [PY, os.path.join(HERE, "elastic.py"), "--runs", str(runs), "--agent", a.agent, "--timeout",
               str(a.elastic_timeout), "--scenarios", scenarios, "--kinds", a.elastic_kinds, "--json", path]
        log(f"elastic: {' '.join(cmd[1:])}")
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        with open(path) as f:
            data = json.load(f)
        os.unlink(path)
        for r in data["results"]:
            out[f"{r['scenario']}/{r['launcher']}"] = stats(r["seconds"]) or {"never": len(r["seconds"])}
        for k, v in data["agent_group_formed_s"].items():
            out[f"{k}/fsdp-agent group formed"] = stats(v)
    return out


def bench_rendezvous(a):
    """6. N simulated nodes form one round on one etcd: rdzv-bench vs torch's etcd-v2."""
    out = {"fsdp-agent": {}, "torch etcd-v2": {}, "writes_per_node": {}}
    etcd = Etcd(v2=True)
    try:
        ep = f"127.0.0.1:{etcd.port}"
        for n in a.rdzv_nodes:
            xs = []
            for _ in range(a.runs_slow):
                r = subprocess.run([a.rdzv_bench, "--endpoint", ep, "--nodes", str(n)], capture_output=True, text=True,
                                   check=True, env=QUIET)
                m = re.search(r"nodes=\d+ seal_s=([0-9.]+) etcd_writes=(\d+)", r.stdout.strip().splitlines()[-1])
                xs.append(float(m.group(1)))
                out["writes_per_node"][n] = int(m.group(2)) / n
            out["fsdp-agent"][n] = stats(xs)
            log(f"rdzv fsdp-agent {n}: {cell(out['fsdp-agent'][n], '{:.3f}')} s")
            # Then one node leaves (lease revoked: a pod delete) or dies (lease expires
            # after --ttl 3 s: SIGKILL) and the survivors re-form.
            for how in ("leave", "kill"):
                xs = []
                for _ in range(a.runs_slow):
                    r = subprocess.run([a.rdzv_bench, "--endpoint", ep, "--nodes", str(n), "--lose", how,
                                        "--ttl", "3"], capture_output=True, text=True, check=True, env=QUIET)
                    last = r.stdout.strip().splitlines()[-1]
                    xs.append(float(re.search(r"reform_s=([0-9.]+)", last).group(1)))
                    # How far etcd's revision moved from the loss to every survivor holding
                    # the next round (the survivors write nothing: a handful, whatever N).
                    w = re.search(r"reform_etcd_writes=(\d+)", last)
                    if w:
                        out.setdefault(f"reform writes {how}", {})[n] = max(
                            int(w.group(1)), out.get(f"reform writes {how}", {}).get(n, 0))
                out.setdefault(f"reform {how}", {})[n] = stats(xs)
                log(f"rdzv re-form after {how} {n}: {cell(out[f'reform {how}'][n], '{:.3f}')} s")
        for n in a.torch_nodes:
            xs = []
            # Sizes that take tens of seconds run once: the suite must stay bounded.
            for _ in range(a.runs_slow if n < 64 else 1):
                try:
                    r = subprocess.run([PY, os.path.join(HERE, "torch_rdzv.py"), "--endpoint", ep, "--nodes", str(n),
                                        "--timeout", str(a.torch_rdzv_timeout)], capture_output=True, text=True,
                                       timeout=a.torch_rdzv_timeout + 60)
                    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
                    m = re.search(r"seal_s=([0-9.]+)", last)
                    xs.append(float(m.group(1)) if m else None)
                except subprocess.TimeoutExpired:
                    xs.append(None)
            out["torch etcd-v2"][n] = stats(xs)
            log(f"rdzv torch etcd-v2 {n}: {cell(out['torch etcd-v2'][n], '{:.3f}')} s")
            s = out["torch etcd-v2"][n]
            if s is None or s["median"] > a.torch_rdzv_stop:
                break  # bigger sizes would not finish in the suite's time
    finally:
        etcd.stop()
    return out


def bench_trainer(a):
    """7. fsdp-trainer vs the same model in Python, 2 ranks; peak RSS by sharding."""
    cmd = [PY, os.path.join(HERE, "trainer.py"), "--runs", str(a.runs_slow), "--agent", a.agent, "--trainer",
           a.trainer] + (["--tiny"] if a.tiny else [])
    log("trainer: " + " ".join(cmd[1:]))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        # Its own output says why (a failed run, a missing binary): show it, then fail.
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        r.check_returncode()
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_script(name, args, stdout_json=False, env=None):
    """Runs bench/<name> with this interpreter, its progress on our stderr. Returns the JSON
    it wrote to --json FILE, or with stdout_json the JSON object it printed last."""
    cmd = [PY, os.path.join(HERE, name)] + args
    log(f"{name}: {' '.join(args)}")
    if stdout_json:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
        if r.returncode != 0:
            sys.stderr.write(r.stdout[-4000:])
            r.check_returncode()
        return json.loads(r.stdout.strip().splitlines()[-1])
    # Under the suite's own temporary directory (main sets TMPDIR), removed with it.
    path = os.path.join(tempfile.gettempdir(), name + ".json")
    subprocess.run(cmd + ["--json", path], check=True, stdout=sys.stderr, env=env)
    with open(path) as f:
        data = json.load(f)
    os.unlink(path)
    return data


def by_launcher(results):
    """elastic.py's and prewarm.py's result list as {scenario/launcher: stats}."""
    return {f"{x['scenario']}/{x['launcher']}": stats(x["seconds"]) or {"never": len(x["seconds"])} for x in results}


def bench_agents_scale(a):
    """6. N real fsdp-agent processes on one etcd: form, then re-form after one loss."""
    out = []
    for n in a.scale_nodes:
        for how in a.scale_hows:
            args = ["--agent", a.agent, "--nodes", str(n), "--how", how, "--idle", str(a.scale_idle)]
            log(f"agents_scale: {' '.join(args)}")
            r = subprocess.run([PY, os.path.join(HERE, "agents_scale.py")] + args, stdout=subprocess.PIPE, text=True)
            if r.returncode != 0:
                sys.stderr.write(r.stdout[-4000:])
                r.check_returncode()
            # One `key=value ...` line per run.
            line = next(l for l in r.stdout.splitlines() if l.startswith("agents="))
            out.append(dict(kv.split("=", 1) for kv in line.split()))
            log(f"agents_scale {n} {how}: re-form {out[-1]['reform_s']} s")
    return out


def bench_hangs(a):
    """8. A stalled rank to the group running again; the cost of progress reports."""
    return run_script("hangs.py", ["--agent", a.agent, "--timeout", str(a.hang_timeout), "--seconds",
                                   str(a.hang_seconds), "--kinds", a.hang_kinds])


def bench_demo(a):
    """9. The elastic demo (scripts/demo/elastic.py): kill, delete and bring back nodes."""
    return run_script("demo.py", ["--agent", a.agent, "--trainer", a.trainer, "--steps", str(a.demo_steps)],
                      stdout_json=True)


def bench_full_shard(a):
    """11. Peak RSS by strategy and world size, the largest model in a budget, samples/s."""
    return run_script("full_shard.py", ["--runs", str(a.runs_shard), "--budget-mib", str(a.budget_mib), "--agent",
                                        a.agent, "--trainer", a.trainer] + (["--tiny"] if a.tiny else []),
                      stdout_json=True)


def bench_prewarm(a):
    """12. First all-reduce after a pod delete, a crash and the first round, --prewarm or not."""
    d = run_script("prewarm.py", ["--runs", str(a.runs_slow), "--agent", a.agent, "--timeout", str(a.prewarm_timeout),
                                  "--scenarios", a.prewarm_scenarios, "--kinds", a.prewarm_kinds, "--settle",
                                  str(a.prewarm_settle), "--spare-wait", str(a.spare_wait)])
    return {"settle_s": d["settle_s"], "timeout_s": d["timeout_s"], "spare_rss_mib": d["spare_rss_mib"],
            "results": by_launcher(d["results"])}


def bench_livelock(a):
    """13. An agent frozen past its lease: one re-form, one restart, no loop."""
    return run_script("livelock.py", ["--agent", a.agent, "--runs", str(a.runs_slow), "--limit", str(a.livelock_limit),
                                      "--freeze", str(a.livelock_freeze), "--work", str(a.livelock_work)])


def sim_run(a, args):
    """One campaign of the simulator: its summary line's figures and the first violation."""
    r = subprocess.run([a.sim, "--threads", "2", "--quiet"] + args, capture_output=True, text=True)
    m = re.search(r"seeds (\d+), events (\d+), violations (\d+) \(([0-9.]+) s, (\d+) seeds/s", r.stdout)
    if m is None:
        sys.stderr.write(r.stdout[-2000:] + r.stderr[-2000:])
        raise RuntimeError(f"{a.sim} {' '.join(args)}: no summary line")
    first = re.search(r"^seed (\d+): (.*)$", r.stderr, re.M)
    return {"seeds": int(m.group(1)), "events": int(m.group(2)), "violations": int(m.group(3)),
            "seconds": float(m.group(4)), "seeds_per_s": int(m.group(5)),
            "first": {"seed": int(first.group(1)), "said": first.group(2)} if first else None}


def bench_sim(a):
    """14. The deterministic simulator: clean campaigns, and each fix switched off."""
    if not os.path.exists(a.sim):
        why = f"{a.sim} is missing (cargo build --release -p fsdp-rendezvous --example sim)"
        log(f"sim: not run: {why}")
        return {"not_run": why}
    out = {"campaigns": [], "switches": {}}
    for seeds, start, agents, faults in a.sim_campaigns:
        args = ["--seeds", str(seeds), "--seed-start", str(start), "--agents", str(agents), "--faults", str(faults)]
        r = sim_run(a, args)
        r.update(start=start, agents=agents, faults=faults)
        out["campaigns"].append(r)
        log(f"sim {' '.join(args)}: {r['violations']} violations, {r['seeds_per_s']} seeds/s")
    for switch in ("old-departures", "old-store", "broken-fence"):
        out["switches"][switch] = sim_run(a, ["--seeds", str(a.sim_switch_seeds), "--switch", switch])
        log(f"sim --switch {switch}: first failing seed {(out['switches'][switch]['first'] or {}).get('seed')}")
    return out


def slurm_missing():
    """Why scripts/slurm/start.sh cannot start its cluster here (what it checks first), or None."""
    missing = [c for c in ("slurmctld", "slurmd", "srun", "scontrol", "sinfo", "munged", "mungekey", "unshare",
                           "nsenter") if shutil.which(c) is None]
    if missing:
        return (f"{', '.join(missing)} not found: scripts/setup.sh installs Debian's slurmctld, slurmd, "
                "slurm-client and munge")
    if os.geteuid() != 0:
        return "not root: the cluster's nodes are namespaces, each with its own bind-mounted /etc/hosts"
    return None


def free_ports(n):
    """A base port with the n ports from it free on the loopback (slurmctld's and the slurmds')."""
    for _ in range(100):
        base = random.randrange(20000, 40000)
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            pass
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports in a row")


def bench_slurm(a):
    """15. A node killed under `srun --no-kill` on the real three-node Slurm of scripts/slurm."""
    why = ("--tiny: the smoke test starts no Slurm cluster (tests/tests/slurm.rs tests the same set-up)" if a.tiny
           else slurm_missing())
    if why:
        log(f"slurm: not run: {why}")
        return {"not_run": why}
    # A cluster of its own, as each Slurm test starts one, but in its own state directory
    # and on its own ports, so that the tests' cluster (fixed ones) may run beside it.
    env = dict(os.environ, FSDP_SLURM_DIR=os.path.join(tempfile.gettempdir(), "slurm"),
               FSDP_SLURM_PORT=str(free_ports(4)))
    d = run_script("slurm.py", ["--runs", str(a.runs_slurm), "--agent", a.agent, "--kinds", a.slurm_kinds,
                                "--limit", str(a.slurm_limit), "--port", str(free_ports(1))], env=env)
    d["version"] = subprocess.run(["srun", "--version"], capture_output=True, text=True).stdout.strip()
    return d


def bench_mixed(a):
    """16. Two nodes, one under torchrun: how soon fsdp-agent says so and exits."""
    return run_script("mixed.py", ["--agent", a.agent, "--cases", a.mixed_cases, "--import-runs",
                                   str(a.import_runs)])


def bench_checkpoint(a):
    """17. Sharded background saves against gathered ones and none, at world 2 and 4."""
    return run_script("checkpoint.py", ["--agent", a.agent, "--trainer", a.trainer, "--worlds", a.ckpt_worlds]
                      + (["--tiny"] if a.tiny else []))


def bench_precision(a):
    """17. bf16 against fp32: fsdp-trainer and PyTorch FSDP2; bf16's losses."""
    return run_script("precision.py", ["--agent", a.agent, "--trainer", a.trainer] + (["--tiny"] if a.tiny else []),
                      stdout_json=True)


def machine():
    mem = next((l.split()[1] for l in open("/proc/meminfo") if l.startswith("MemTotal")), "0")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    ver = lambda cmd: subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()[0]
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    torch_v = subprocess.run([PY, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True).stdout.strip()
    return {
        "cpus": os.cpu_count(), "cpu": cpu, "memory_gib": round(int(mem) / 1024 / 1024, 1),
        "kernel": platform.release(), "fsdp_agent": rev, "torch": torch_v,
        "etcd": ver(["etcd", "--version"]), "rustc": ver(["rustc", "--version"]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def report(a, m, r, took, elapsed):
    figs = os.path.join(a.out, "bench")
    os.makedirs(figs, exist_ok=True)
    md = ["# Benchmarks", "",
          "Every figure below is measured side by side with torchrun from the same PyTorch venv, in one run of",
          "`scripts/bench.sh` (which builds the release binaries and runs `bench/suite.py`). This file and the",
          "plots in `docs/bench/` are generated; edit `bench/suite.py`, not this file.", "",
          f"Machine: {m['cpus']} CPUs ({m['cpu']}), {m['memory_gib']} GiB, Linux {m['kernel']}. "
          f"Versions: fsdp-agent {m['fsdp_agent']}, torch {m['torch']}, {m['etcd']}, {m['rustc']}. "
          f"Run {m['date']}, {elapsed / 60:.1f} minutes{' (--tiny: smoke-test sizes, not figures)' if a.tiny else ''}.", "",
          "Cells are median [min–max] over the runs; \"never\" means not within the timeout. Ratios are torchrun's",
          "median over fsdp-agent's (higher is better for fsdp-agent).", ""]

    L = r["launch"]
    md += ["## 1. Single-node launch", "",
           f"`LAUNCHER --standalone --nproc-per-node N --no-python /bin/true`, exec to exit (every worker exec'd and "
           f"reaped), {a.runs} runs each after one warm-up.", "",
           "| N | fsdp-agent ms | torchrun ms | ratio |", "|---|---|---|---|"]
    for n in a.nprocs:
        o, t = L[f"fsdp-agent/{n}"], L[f"torchrun/{n}"]
        md.append(f"| {n} | {cell(o, '{:.1f}')} | {cell(t, '{:.0f}')} | {ratio(t, o)} |")
    with open(os.path.join(figs, "launch.svg"), "w") as f:
        f.write(svg.bars("Launch to all workers done (ms, log scale)", "ms", [f"N={n}" for n in a.nprocs],
                         ["fsdp-agent", "torchrun"],
                         [[L[f"fsdp-agent/{n}"]["median"] for n in a.nprocs], [L[f"torchrun/{n}"]["median"] for n in a.nprocs]],
                         log=True))
    md += ["", "![launch](bench/launch.svg)", ""]

    I = r["idle"]
    md += ["## 2. Supervising idle workers", "",
           f"`LAUNCHER --standalone --nproc-per-node {a.idle_workers} --no-python /bin/sleep {a.idle_seconds}`: the "
           f"launcher's peak RSS and CPU time (user + system, from `wait4`), {a.runs_slow} runs.", "",
           "| | fsdp-agent | torchrun | ratio |", "|---|---|---|---|",
           f"| peak RSS MiB | {cell(I['fsdp-agent']['rss_mib'], '{:.1f}')} | {cell(I['torchrun']['rss_mib'], '{:.0f}')} | "
           f"{ratio(I['torchrun']['rss_mib'], I['fsdp-agent']['rss_mib'])} |",
           f"| CPU ms | {cell(I['fsdp-agent']['cpu_ms'], '{:.0f}')} | {cell(I['torchrun']['cpu_ms'], '{:.0f}')} | "
           f"{ratio(I['torchrun']['cpu_ms'], I['fsdp-agent']['cpu_ms'])} |", ""]
    with open(os.path.join(figs, "idle.svg"), "w") as f:
        f.write(svg.bars(f"Launcher cost with {a.idle_workers} idle workers (log scale)", "MiB / ms",
                         ["peak RSS MiB", "CPU ms"], ["fsdp-agent", "torchrun"],
                         [[I["fsdp-agent"]["rss_mib"]["median"], I["fsdp-agent"]["cpu_ms"]["median"] or None],
                          [I["torchrun"]["rss_mib"]["median"], I["torchrun"]["cpu_ms"]["median"] or None]], log=True))
    md += ["![idle](bench/idle.svg)", ""]

    E = r["elastic"]
    kinds = a.elastic_kinds.split(",")
    scen = [s for group, _ in a.elastic_plan for s in group.split(",")]
    desc = {"startup-2": "2 nodes: last node started → every worker running",
            "startup-4": "4 nodes: last node started → every worker running",
            "reform-KILL": "3 nodes, SIGKILL of one pod → survivors' workers running in a group of 2",
            "reform-TERM": "3 nodes, SIGTERM of one pod (a pod delete) → survivors' workers running in a group of 2",
            "scaleup-3": "2 nodes running, a third started → every worker running in a group of 3"}
    md += ["## 3–5. Multi-node: start, re-form, scale-up", "",
           "`bench/elastic.py`: each pod is a launcher in its own PID and UTS namespace with its own 127.0.x.1 "
           "address, on a real etcd (c10d, torchrun's and ours: no etcd, pod0 hosts the store, and a different pod is "
           "killed). The workers are "
           "`tests/py/elastic_worker.py` (gloo all-reduce loop with a checkpointed step); a worker logs a start line, "
           "and the clock stops when every expected worker has logged one with the expected world size. "
           f"fsdp-agent runs with `--max-restarts 0` and its default lease TTL (5 s); torchrun gets `--max-restarts 3` (it only "
           f"recovers by restarting its workers) and `--monitor-interval 0.1`. Timeout {a.elastic_timeout:.0f} s.", "",
           "| scenario | " + " | ".join(f"{k} s" for k in kinds) + " | " +
           " | ".join(f"ratio {k}" for k in kinds if k != "fsdp-agent") + " |",
           "|---" * (1 + len(kinds) + len(kinds) - 1) + "|"]
    for s in scen:
        ours = E.get(f"{s}/fsdp-agent")
        ours = ours if ours and "median" in ours else None
        row = [desc.get(s, s)]
        for k in kinds:
            v = E.get(f"{s}/{k}")
            row.append(cell(v if v and "median" in v else None))
        for k in kinds:
            if k != "fsdp-agent":
                v = E.get(f"{s}/{k}")
                row.append(ratio(v if v and "median" in v else None, ours) if v and "median" in v
                           else f"not within {a.elastic_timeout:.0f} s")
        md.append("| " + " | ".join(row) + " |")
    for s in scen:
        g = E.get(f"{s}/fsdp-agent group formed")
        if g:
            md.append(f"\nfsdp-agent {s}: from the kill to the new group formed (agent log): {cell(g, '{:.3f}')} s; "
                      "the rest is the workers' own start (python, torch import, gloo).")
    with open(os.path.join(figs, "elastic.svg"), "w") as f:
        vals = []
        for k in kinds:
            vals.append([(E.get(f"{s}/{k}") or {}).get("median") for s in scen])
        f.write(svg.bars("Multi-node scenarios (s, log scale; n/a = never)", "seconds", scen, kinds, vals, log=True,
                         width=760))
    md += ["", "![elastic](bench/elastic.svg)", ""]

    R = r["rendezvous"]
    md += ["## 6. Rendezvous at scale", "",
           "N simulated nodes join one run on one etcd and the clock stops when every node holds the sealed round. "
           "fsdp-agent: `target/release/rdzv-bench --endpoint E --nodes N` (tasks sharing a few connections). "
           "torch: `bench/torch_rdzv.py` drives `DynamicRendezvousHandler` on its etcd-v2 backend (what "
           "`torchrun --rdzv-backend etcd-v2` uses) with one thread per node, `min_nodes = max_nodes = N`; it stops "
           f"growing N once a size takes more than {a.torch_rdzv_stop:.0f} s.", "",
           "| N | fsdp-agent s | etcd writes per node | torch etcd-v2 s | ratio |", "|---|---|---|---|---|"]
    sizes = sorted(set(R["fsdp-agent"]) | set(R["torch etcd-v2"]), key=int)
    reform_rows = ["", "Re-form after one loss, same N: one node then leaves (its lease revoked, as on a pod "
                   "delete) or dies (no word: its 3 s lease expires, as on SIGKILL); the clock runs from the loss "
                   "to every survivor holding the next round (`rdzv-bench --nodes N --lose leave|kill --ttl 3`, "
                   "MIN = N−1). The etcd writes of a re-form are how far etcd's revision moved from the loss to "
                   "every survivor holding the next round (the most over the runs).", "",
                   "| N | leave s | etcd writes (leave) | kill s (TTL 3 s) | etcd writes (kill) |",
                   "|---|---|---|---|---|"]
    for n in sorted(R.get("reform leave", {}), key=int):
        reform_rows.append(f"| {n} | {cell(R['reform leave'][n], '{:.3f}')} | "
                           f"{R.get('reform writes leave', {}).get(n, '–')} | "
                           f"{cell(R.get('reform kill', {}).get(n), '{:.3f}')} | "
                           f"{R.get('reform writes kill', {}).get(n, '–')} |")
    for n in sizes:
        o, t = R["fsdp-agent"].get(n), R["torch etcd-v2"].get(n)
        w = R["writes_per_node"].get(n)
        md.append(f"| {n} | {cell(o, '{:.3f}') if n in R['fsdp-agent'] else '–'} | {f'{w:.2f}' if w else '–'} | "
                  f"{cell(t, '{:.2f}') if n in R['torch etcd-v2'] else 'not run'} | {ratio(t, o)} |")
    series = [("fsdp-agent", [(int(n), s["median"]) for n, s in R["fsdp-agent"].items() if s]),
              ("torch etcd-v2", [(int(n), s["median"]) for n, s in R["torch etcd-v2"].items() if s])]
    series = [s for s in series if s[1]]
    if series:
        with open(os.path.join(figs, "rendezvous.svg"), "w") as f:
            f.write(svg.lines_loglog("Time to seal one round vs nodes", "simulated nodes", "seconds", series))
        md += ["", "![rendezvous](bench/rendezvous.svg)", ""]
    md += reform_rows + [""] + md_agents_scale(a, r["agents_scale"])

    T = r["trainer"]
    sp = T["speed"]
    md += ["## 7. Trainer throughput and memory", "",
           "`bench/trainer.py`: fsdp-trainer against `trainer/baseline/train_baseline.py` (the same model, "
           "initialisation, samples and schedule in Python/PyTorch with DDP and torch.optim.AdamW), both launched "
           "by fsdp-agent with 2 ranks on CPU, one thread per rank, a 4-layer, 256-wide model, 128 tokens × 8 "
           "sequences per rank; samples/s is the median of the logged speeds after the first two, per run.", "",
           "| | fsdp-trainer | Python/PyTorch | ratio |", "|---|---|---|---|",
           f"| samples/s | {cell(stats(sp['fsdp-trainer']), '{:.1f}')} | {cell(stats(sp['python']), '{:.1f}')} | "
           f"{T['speed_ratio']:.2f}x |", "",
           "Peak RSS per rank (VmHWM), 2 ranks, 2 steps, one model big enough for the optimizer state to show ("
           + (T["memory"]["no_shard"].get("model", "").split(";")[0].replace("Model: ", "") or "model")
           + "); the optimizer state each rank holds is in the last column:", "",
           "| | peak RSS MiB per rank | optimizer state per rank |", "|---|---|---|"]
    for k in ("no_shard", "shard_grad_op", "python-ddp"):
        p = T["memory"][k]["peak_rss_mib_per_rank"]
        st = re.search(r"([0-9.]+ MiB) optimizer state", T["memory"][k].get("model", ""))
        md.append(f"| {'fsdp-trainer ' + k if k != 'python-ddp' else 'Python DDP baseline'} | "
                  f"{', '.join(f'{x:.0f}' for x in p) if p else '–'} | {st.group(1) if st else 'all of it (AdamW)'} |")
    with open(os.path.join(figs, "trainer.svg"), "w") as f:
        f.write(svg.bars("Peak RSS per rank (max over ranks, MiB)", "MiB", ["no_shard", "shard_grad_op", "Python DDP"],
                         ["peak RSS"], [[max(T["memory"][k]["peak_rss_mib_per_rank"] or [0]) or None
                                         for k in ("no_shard", "shard_grad_op", "python-ddp")]]))
    md += ["", "![trainer](bench/trainer.svg)", "",
           "The trainer's shard saving is the optimizer state divided by the world size (2 here); Gloo's CPU "
           "reduce-scatter and all-gather make `shard_grad_op` slower than `no_shard` on CPU.", ""]
    md += md_hangs(a, r["hangs"])
    md += md_demo(a, r["demo"])
    md += md_c10d(a, E)
    md += md_full_shard(a, r["full_shard"])
    md += md_prewarm(a, r["prewarm"], m)
    md += md_livelock(a, r["livelock"])
    md += md_sim(a, r["sim"])
    md += md_slurm(a, r["slurm"])
    md += md_mixed(a, r["mixed"])
    md += md_trainer_issue31(a, r["checkpoint"], r["precision"])
    md += md_reproduce(a, took)
    with open(os.path.join(figs, "results.json"), "w") as f:
        json.dump({"machine": m, "results": r, "minutes": {k: v / 60 for k, v in took.items()}}, f, indent=1,
                  default=str)
    with open(os.path.join(a.out, "benchmarks.md"), "w") as f:
        f.write("\n".join(md))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "docs"))
    ap.add_argument("--runs", type=int, default=5, help="runs of the quick benchmarks")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--agent", default=os.path.join(ROOT, "target/release/fsdp-agent"))
    ap.add_argument("--trainer", default=os.path.join(ROOT, "target/release/fsdp-trainer"))
    ap.add_argument("--rdzv-bench", dest="rdzv_bench", default=os.path.join(ROOT, "target/release/rdzv-bench"))
    ap.add_argument("--only", default="launch,idle,elastic,rendezvous,trainer")
    a = ap.parse_args()
    if a.tiny:
        a.runs, a.runs_slow, a.nprocs = 1, 1, [1]
        a.idle_workers, a.idle_seconds = 2, 1
        a.elastic_plan, a.elastic_kinds, a.elastic_timeout = [("startup-2", 1)], "fsdp-agent,torchrun-c10d", 40
        a.rdzv_nodes, a.torch_nodes, a.torch_rdzv_timeout, a.torch_rdzv_stop = [8], [4], 60, 30
    else:
        a.runs_slow, a.nprocs = 3, [1, 2, 8]
        a.idle_workers, a.idle_seconds = 8, 10
        a.elastic_plan = [("startup-2,startup-4", 3), ("reform-TERM,reform-KILL,scaleup-3", 2)]
        a.elastic_kinds, a.elastic_timeout = "fsdp-agent,fsdp-agent-c10d,torchrun-c10d,torchrun-etcd-v2", 40
        a.rdzv_nodes, a.torch_nodes, a.torch_rdzv_timeout, a.torch_rdzv_stop = [8, 64, 256, 1000], [8, 16, 32, 64, 128], 90, 10
    for p in (a.agent, a.rdzv_bench, a.trainer, TORCHRUN):
        if not os.path.exists(p):
            sys.exit(f"bench: {p} is missing; run scripts/bench.sh (it builds the release binaries)")
    t0 = time.monotonic()
    m = machine()
    log(f"machine: {m}")
    steps = {"launch": bench_launch, "idle": bench_idle, "elastic": bench_elastic, "rendezvous": bench_rendezvous,
             "trainer": bench_trainer}
    results = {k: steps[k](a) for k in a.only.split(",")}
    if set(results) == set(steps):
        report(a, m, results, time.monotonic() - t0)
        log(f"wrote {os.path.join(a.out, 'benchmarks.md')} in {(time.monotonic() - t0) / 60:.1f} min")
    else:
        print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
