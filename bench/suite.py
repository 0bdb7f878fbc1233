"""The benchmark suite: every figure of docs/benchmarks.md, measured in one run on this
machine (side by side with torchrun, from the same PyTorch venv, wherever it has a
counterpart), and the whole of docs/benchmarks.md regenerated from the results, with tables
and SVG plots. Each step runs one benchmark (bench/*.py, rdzv-bench, the simulator) and
reads its figures; STEPS lists the steps with their estimates.

usage: scripts/bench.sh            (builds release binaries, then runs this)
       python bench/suite.py [--out docs] [--runs 5] [--tiny] [--only STEP,...]

--tiny runs every benchmark at the smallest size once (the smoke test uses it; it starts no
Slurm cluster unless --only names slurm); it writes its report where --out says, never over
docs/ unless told to. --only runs those steps and prints their results as JSON, writing
nothing.
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
import full_shard  # noqa: E402  (its tables of §11)
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
        out.update(by_launcher(data["results"]))
        for k, v in data["agent_group_formed_s"].items():
            out[f"{k}/fsdp-agent group formed"] = stats(v)
    return out


ELASTIC_DESC = {"startup-2": "2 nodes: last node started → every worker running",
                "startup-4": "4 nodes: last node started → every worker running",
                "reform-KILL": "3 nodes, SIGKILL of one pod → survivors' workers running in a group of 2",
                "reform-TERM": "3 nodes, SIGTERM of one pod (a pod delete) → survivors' workers running in a group "
                               "of 2",
                "scaleup-3": "2 nodes running, a third started → every worker running in a group of 3"}


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
            # The floor this etcd on this machine sets: a lease, a key and a watch per
            # node and nothing else (no protocol can do less).
            r = subprocess.run([a.rdzv_bench, "--endpoint", ep, "--nodes", str(n), "--ceiling"],
                               capture_output=True, text=True, check=True, env=QUIET)
            # The floor's line (a line on its renewals follows it).
            m = re.search(r"nodes=\d+ ceiling_s=([0-9.]+)", r.stdout)
            out.setdefault("etcd floor", {})[n] = float(m.group(1))
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
    d = run_script("prewarm.py", ["--runs", str(a.runs_prewarm), "--agent", a.agent, "--timeout",
                                  str(a.prewarm_timeout), "--scenarios", a.prewarm_scenarios, "--kinds",
                                  a.prewarm_kinds, "--settle", str(a.prewarm_settle), "--spare-wait", str(a.spare_wait)])
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
        why = f"{a.sim} is missing (cargo build --release -p fsdp-rendezvous --features sim --example sim)"
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
    if a.tiny and not a.slurm_asked:
        why = ("--tiny: the smoke test starts no Slurm cluster (tests/tests/slurm.rs tests the same set-up; "
               "`--tiny --only slurm` runs this step at its tiny size)")
    else:
        why = slurm_missing()
    if why:
        log(f"slurm: not run: {why}")
        return {"not_run": why}
    # A cluster of its own, as each Slurm test starts one, but in its own state directory
    # and on its own ports, so that the tests' cluster (fixed ones) may run beside it.
    # munged runs as the munge user and reaches its files through the suite's directory.
    os.chmod(tempfile.gettempdir(), 0o755)
    env = dict(os.environ, FSDP_SLURM_DIR=os.path.join(tempfile.gettempdir(), "slurm"),
               FSDP_SLURM_PORT=str(free_ports(4)))
    d = run_script("slurm.py", ["--runs", str(a.runs_slurm), "--agent", a.agent, "--kinds", a.slurm_kinds,
                                "--limit", str(a.slurm_limit), "--steps", str(a.slurm_steps), "--port",
                                str(free_ports(1))], env=env)
    # (srun --version wants a cluster's configuration; slurmd's does not.)
    d["version"] = subprocess.run(["slurmd", "-V"], capture_output=True, text=True).stdout.strip()
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


def bench_goodput(a):
    """18. Goodput: a seeded schedule of kills, deletes and returns, each launcher in turn."""
    args = ["--agent", a.agent, "--trainer", a.trainer, "--kinds", a.goodput_kinds,
            "--svg", os.path.join(a.out if set(STEPS) <= set(a.steps) else tempfile.gettempdir(), "bench",
                                  "goodput.svg")]
    os.makedirs(os.path.dirname(args[-1]), exist_ok=True)
    return run_script("goodput.py", args + (["--tiny"] if a.tiny else ["--minutes", str(a.goodput_minutes)]))


def bench_stragglers(a):
    """19. A node slowed to half its CPU by a cgroup: named, and replaced by a spare."""
    if a.tiny:
        why = ("--tiny: a run takes 7 minutes on 2 cores (tests/tests/stragglers.rs slows, names and replaces "
               "a node in the test command)")
        log(f"stragglers: not run: {why}")
        return {"not_run": why}
    return run_script("stragglers.py", ["--agent", a.agent, "--trainer", a.trainer])


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


TINY_SKIP = "not run (--tiny)"


def skipped(a):
    return TINY_SKIP if a.tiny else "not run"


def shown_path(p):
    """p as the report names it: from the repository's root when it is inside."""
    rel = os.path.relpath(p, ROOT)
    return p if rel.startswith("..") else rel


def secs(x, fmt="{:.2f}"):
    return "never" if x is None else fmt.format(x) + " s"


def span(xs, fmt="{:.2f}"):
    """A few figures as min–max (one figure alone)."""
    xs = [x for x in xs or [] if x is not None]
    if not xs:
        return "–"
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo}–{hi}"


def md_agents_scale(a, S):
    md = ["Real agents (processes, not tasks): `bench/agents_scale.py --nodes N --how term|kill` starts N `fsdp-agent` "
          "processes on one local etcd (one `/bin/sleep` worker each, `--nnodes N−1:N`, lease TTL 5 s, each with a "
          "status port its ring neighbour watches), waits for the round of N, then takes one out: SIGTERM (it "
          "revokes its lease) or SIGKILL (its status port refuses; its lease would expire after the TTL). Times come "
          "from the survivors' own `group formed` lines; etcd writes are how far etcd's revision moved from the loss "
          "to a second after the last survivor formed; idle load is the machine's CPU load (1.00: every core busy) "
          f"over {a.scale_idle:g} s while the formed group does nothing; agent CPU is what each survivor used from the "
          "loss to a second after the last formed (the scheduler's count, in ns). The agents' logs and `TMPDIR` are on "
          "`/dev/shm`, etcd's data on disk. Larger N, the floor that the least possible agent sets on this machine "
          "(`--floor`), and how these figures came down: "
          "[bench/agents-scale.md](bench/agents-scale.md).", "",
          "| N | taken out by | form s | re-form s (slowest) | p50 s | p99 s | etcd writes | survivors exited | "
          "survivors fenced | idle load | agent CPU ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in S:
        md.append(f"| {x['agents']} | {'SIGTERM' if x['how'] == 'term' else 'SIGKILL'} | {x['form_s']} | "
                  f"{x['reform_s']} | {x['p50_s']} | {x['p99_s']} | {x['writes']} | {x['exited']} | {x['fenced']} | "
                  f"{x['idle_busy']} | {x['agent_cpu_ms']} |")
    return md + [""]


def md_hangs(a, H):
    def stall(kind):
        if kind not in H["stall_s"]:
            return skipped(a)
        s = H["stall_s"][kind]
        if s is not None:
            return f"{s:.2f} s"
        if kind == "torchrun":
            return (f"not within {H['timeout_s']:.0f} s: torchrun has no hang detection, and the group waits for "
                    "gloo's collective timeout (30 min by default)")
        return f"not within {H['timeout_s']:.0f} s"
    on, off, t = H["cost"]["on"], H["cost"]["off"], H["seconds"]
    return ["## 8. Hangs", "",
            "`bench/hangs.py`. Stall: `tests/py/hang_worker.py`, 2 gloo ranks, steps of 0.2 s; on the first attempt "
            "rank 1 stalls after its all-reduce of step 10. The clock runs from the stall (the stalled rank prints "
            "its time) to the last restarted rank's start line.", "",
            f"| | fsdp-agent (`--hang-min {H['hang_min_s']}`, automatic timeout) | torchrun (`--max-restarts 1`) |",
            "|---|---|---|",
            f"| stall → both ranks running again from the checkpoint | {stall('fsdp-agent')} | "
            f"{stall('torchrun')} |", "",
            f"fsdp-agent's figure is its allowance ({H['hang_min_s']} s, or 10 steps' time if that is longer), up to a "
            "second to its next look, the py-spy dumps, then the restart: Python, the torch import, gloo.", "",
            f"Cost of progress reports: 2 workers each sending 1,000 step reports a second for {t:g} s (paced busy "
            "loop):", "",
            "| | reports on | `--hang-timeout off` (no socket) |", "|---|---|---|",
            f"| agent CPU time over the {t:g} s | {on['agent_cpu_s']:.2f} s ({on['agent_cpu_s'] / t * 100:.1f} % of "
            f"one core) | {off['agent_cpu_s']:.2f} s |",
            f"| agent peak RSS | {on['agent_rss_mib']:.1f} MiB | {off['agent_rss_mib']:.1f} MiB |",
            f"| steps the workers reached | {on['steps_per_s']:,.0f}/s | {off['steps_per_s']:,.0f}/s |", ""]


DEMO_EVENTS = {"node 2 killed": "node 2 SIGKILLed", "node 1 deleted": "node 1 SIGTERMed (pod delete)"}


def md_demo(a, D):
    md = ["## 9. The elastic demo", "",
          "`bench/demo.py` runs the demo of `scripts/demo.sh` (`scripts/demo/elastic.py`, as it is) and reads its "
          "events: three agents on one etcd, `--nnodes 2:3`, one `fsdp-trainer` worker each "
          f"({D['params'] / 1e6:.1f}M parameters), {D['steps']} steps, a checkpoint every {D['ckpt_every']}. "
          "\"Re-formed\" runs from the event to the last survivor's `group formed` (agent timestamps); \"training "
          "again\" to the first step the resumed group logs (the narrator's clock, ±0.05 s).", "",
          "| event | at step | re-formed in | training again | world | resumed from | steps redone |",
          "|---|---|---|---|---|---|---|"]
    for e in D["events"]:
        md.append(f"| {DEMO_EVENTS.get(e['event'], e['event'])} | {e['at_step']} | {e['reformed_s']:.2f} s | "
                  f"{e['training_s']:.1f} s | {e['world']} | {e['resumed_from']} | {e['redone']} |")
    return md + ["", "A SIGKILLed node is proven dead by its ring neighbour, which finds its status port refused, not "
                 "waited out for its lease ([rendezvous.md](rendezvous.md#a-dead-process-is-proof-ring-liveness)). "
                 "\"Steps redone\" is bounded by the checkpoint interval: `fsdp-trainer` does not save on SIGTERM. "
                 "Every agent exited 0 (the demo fails otherwise).", ""]


def md_c10d(a, E):
    kinds = a.elastic_kinds.split(",")
    scen = [s for group, _ in a.elastic_plan for s in group.split(",")]

    def get(s, k):
        v = E.get(f"{s}/{k}")
        return v if v and "median" in v else None

    md = ["## 10. c10d without etcd", "",
          "§3–5's runs, the c10d launchers beside fsdp-agent on etcd. `fsdp-agent-c10d` is `--rdzv-backend c10d` "
          "with no etcd: pod0's agent serves the store (`is_host=1` there, `0` elsewhere, as for torchrun) and a "
          "different pod is killed.", "",
          "| scenario | fsdp-agent (etcd) s | fsdp-agent c10d s | torchrun c10d s | ratio torchrun c10d / fsdp-agent "
          "c10d |", "|---|---|---|---|---|"]
    for s in scen:
        row = [ELASTIC_DESC.get(s, s)]
        for k in ("fsdp-agent", "fsdp-agent-c10d", "torchrun-c10d"):
            row.append(cell(get(s, k)) if k in kinds else skipped(a))
        ours, theirs = get(s, "fsdp-agent-c10d"), get(s, "torchrun-c10d")
        row.append(ratio(theirs, ours) if ours and theirs else "–")
        md.append("| " + " | ".join(row) + " |")
    return md + ["", "torchrun's c10d recovers from a lost pod only through its workers' failure and a restart, and "
                 "does not grow a running group. fsdp-agent's c10d store lives in pod0's agent and carries the same "
                 "rounds as etcd ([rendezvous.md](rendezvous.md#c10d-the-same-rendezvous-without-an-etcd)).", ""]


def md_full_shard(a, F):
    md = ["## 11. Full sharding (FSDP / ZeRO-3)", "",
          f"`bench/full_shard.py --runs {a.runs_shard} --budget-mib {a.budget_mib}{' --tiny' if a.tiny else ''}`: "
          "fsdp-trainer's `full` against `no_shard` and `shard_grad_op`, and against PyTorch's FSDP2 on CPU/Gloo. "
          "Every rank runs one intra-op thread; all ranks share the machine's cores, launched by "
          "`fsdp-agent --standalone`.", ""]
    rows = F["memory"]
    md += full_shard.render({"memory": rows}).splitlines() + [""]
    n, unit = rows[0]["params"], max(x["unit_mib"] or 0 for x in rows)
    worlds = sorted({x["world"] for x in rows})
    peak = {(x["world"], x["strategy"]): max(x["peak_mib"]) for x in rows}
    lowest = [str(w) for w in worlds if peak[(w, "full")] <= min(peak[(w, s)] for s in full_shard.STRATEGIES)]
    shares = []
    for w in worlds:
        pred = 16 * n * (1 - 1 / w) / 2**20 - 3 * unit
        if w > 1 and pred > 0:
            shares.append(f"{(peak[(w, 'no_shard')] - peak[(w, 'full')]) / pred * 100:.0f}% of it at world {w}")
    md += [f"`full` is the lowest at world {', '.join(lowest) or '–'}. Between steps `no_shard` holds parameters, "
           "gradients and both AdamW moments whole, 16 bytes a parameter; `full` holds 1/world of each, and while it "
           "computes, at most three units whole (the unit computing, the next one prefetched, the computing unit's "
           f"gradient; the largest unit here is {unit * 2**20 / 4 / 1e6:.1f}M parameters, {unit:.0f} MiB). So the "
           "arithmetic predicts a saving of 16·N·(1 − 1/world) bytes less three units; the measured saving is "
           f"{'; '.join(shares) or '–'} (`trainer/tests/trainer.rs` checks, on a smaller model, that the saving lies "
           "between that and 16·N·(1 − 1/world) less one unit, 10% either side: how many units overlap at the peak "
           "depends on the threads' timing). At world 1 `full` only adds the units. `shard_grad_op` saves the "
           "moments' share (8·N·(1 − 1/world)) but keeps parameters and gradients whole.", ""]
    md += full_shard.render({"budget": F["budget"], "budget_mib": F["budget_mib"]}).splitlines() + [""]
    layers = {(x["world"], x["strategy"]): x["layers"] for x in F["budget"]}
    grow = [f"{layers[(w, 'full')] / layers[(w, 'no_shard')]:.1f}× `no_shard`'s layers at world {w}"
            for w in sorted({w for w, _ in layers}) if layers.get((w, "no_shard")) and (w, "full") in layers]
    md += ["The limit is RLIMIT_DATA (`ulimit -d`, heap and anonymous mappings: everything the trainer allocates, "
           "not libtorch's code), applied to each rank by `/bin/sh -c 'ulimit -d ...; exec fsdp-trainer ...'`; a "
           "model \"trains\" when both steps finish. `no_shard` is capped at what one rank holds whatever the world "
           "size; `full` grows with the world size" + (f" ({', '.join(grow)})" if grow else "") + ", less than in "
           "proportion because each rank keeps a fixed share on top of its shard: the whole units in flight and "
           "Gloo's own buffers for their collectives.", ""]
    md += full_shard.render({"speed": F["speed"]}).splitlines() + [""]
    sp = {k: statistics.median(v) for k, v in F["speed"].items()}
    fsdp2 = sp.get("python FSDP2")
    md += ["On CPU, `full` pays for its memory with time: every step all-gathers every unit twice and "
           "reduce-scatters it once over loopback Gloo, and recomputes each layer's forward pass in the backward pass "
           "(activation checkpointing). PyTorch's FSDP2 (`fully_shard` on each unit and the root, "
           "`torch.utils.checkpoint` per layer; `bench/fsdp2_baseline.py`, which prints the same losses step by step) "
           "is the like-for-like comparison; the DDP baseline is §7's. "
           + (f"`full` runs at {sp['full'] / fsdp2:.2f}× FSDP2's speed. " if fsdp2 else f"FSDP2: {skipped(a)}. ")
           + f"Prefetch (the next unit's all-gather on Gloo's threads while the current unit computes): "
           f"{sp['full']:.1f} samples/s with it, {sp['full, no prefetch']:.1f} without; on few cores Gloo's threads "
           "compete with the compute for the same cores.", ""]
    return md


PREWARM_DESC = {"reform-TERM": "3 pods, SIGTERM of one (a pod delete) → the group of 2's first all-reduce",
                "crash": "2 pods, SIGKILL of one worker → the restarted group's first all-reduce",
                "startup-3": "3 pods started together → every rank's first all-reduce"}
PREWARM_KINDS = {"fsdp-agent-prewarm": "fsdp-agent --prewarm", "fsdp-agent": "fsdp-agent (cold)",
                 "torchrun-c10d": "torchrun c10d", "torchrun-etcd-v2": "torchrun etcd-v2"}


def md_prewarm(a, P, m):
    kinds = a.prewarm_kinds.split(",")
    R = P["results"]
    md = ["## 12. Pre-warmed workers (`--prewarm`)", "",
          "How soon the workers train again, measured where it matters: the first all-reduce of the new group "
          "completing in the workers themselves (the `allreduced ... t=` line of `tests/py/elastic_worker.py`, wall "
          "clock; pods as in §3–5). "
          f"`bench/prewarm.py --runs {a.runs_prewarm} --timeout {P['timeout_s']:g} --settle {P['settle_s']:g}`, "
          f"side by side in one run: {', '.join(PREWARM_KINDS.get(k, k) for k in kinds)}; torchrun gets "
          "`--max-restarts 3`, fsdp-agent too (the crash needs it), and torchrun c10d's store is on pod0. Each "
          f"fault comes after {P['settle_s']:g} s of training, by when the spares for the next start have finished "
          "importing.", "",
          "| event → | " + " | ".join(PREWARM_KINDS.get(k, k) for k in kinds) + " |", "|---" * (1 + len(kinds)) + "|"]
    for sc in a.prewarm_scenarios.split(","):
        vals = [R.get(f"{sc}/{k}") for k in kinds]
        md.append(f"| {PREWARM_DESC.get(sc, sc)} | " + " | ".join(cell(v if v and "median" in v else None)
                                                                   for v in vals) + " |")
    term = R.get("reform-TERM/fsdp-agent-prewarm")
    target = ""
    if term and "median" in term:
        met = "met" if term["median"] < 0.5 else "not met"
        target = (f"The target, training again within 0.5 s of a pod delete, is {met} on this machine "
                  f"({term['median']:.2f} s). ")
    md += ["", target + "With `--prewarm` the agent re-forms in tens of milliseconds and the survivors' spares are "
           "past `import torch`, so what is left is `init_process_group` and one all-reduce; on few cores the new "
           "spares' own imports compete with the workers' start-up. A crash costs more than a pod delete: the failed "
           "worker's exit is seen through its process, the group is stopped with SIGTERM and the failure is charged "
           "and sealed in a new round before anyone starts. Cold, every start pays the torch import; torchrun adds "
           "its monitor interval, rendezvous and (on a lost peer) a worker failure before it restarts anything.", "",
           "A spare starts importing when its agent starts, so the first round gains only what the rendezvous "
           "overlaps: when every pod starts at once that is nothing (the round seals in milliseconds and waits for "
           "the imports). It pays when the last node joins later than the others' imports take, as in a scale-up or "
           "a late pod.", ""]
    if P["spare_rss_mib"]:
        md += [f"Idle spare with torch imported: **{P['spare_rss_mib']:.0f} MiB** resident (torch {m['torch']}), one "
               "per local rank, always. It holds no GPU memory: importing torch creates no CUDA context.", ""]
    else:
        md += [f"Idle spare's resident memory: {skipped(a)}.", ""]
    return md + ["On the GPU host lent to this project (16 cores, one H100): "
                 "[prewarm.md](prewarm.md#measured-on-a-gpu-host-2026-11-25).", ""]


def md_livelock(a, L):
    n = len(L["runs"])
    md = ["## 13. A frozen agent: the livelock (issue 26)", "",
          f"The command outside testing found: a one-node etcd job, lease TTL {L['ttl_s']} s, whose first attempt's "
          f"worker freezes its own agent for {L['freeze_s']:g} s (SIGSTOP, then SIGCONT) — a node swapping hard, a "
          f"VM pause; the restarted worker then runs {L['work_s']:g} s. `bench/livelock.py --runs {n} --limit "
          f"{L['limit_s']:g} --freeze {L['freeze_s']:g} --work {L['work_s']:g}`, one etcd:", "",
          "| run | exit | worker starts (`TORCHELASTIC_RESTART_COUNT`) | rounds sealed | etcd revisions used | "
          "seconds | a seal held by the pace net |", "|---|---|---|---|---|---|---|"]
    for i, x in enumerate(L["runs"], 1):
        code = x["exit"] if x["exit"] is not None else f"killed at {L['limit_s']:g} s"
        md.append(f"| {i} | {code} | {', '.join(x['starts'])} | {x['rounds_sealed']:,} | {x['etcd_revisions']:,} | "
                  f"{x['seconds']:.1f} | {'yes' if x['held'] else 'no'} |")
    return md + ["", f"**{L['ok']} of {n}** runs exit 0 with the worker restarted once and at most 5 rounds sealed. "
                 "After the thaw the agent seals one round to re-form and charges the restart (the worker's second "
                 "start sees `TORCHELASTIC_RESTART_COUNT=1`). The coordinator's safety net (3 seals per basis, 5 a "
                 "second, then doubling holds: [rendezvous.md](rendezvous.md#loops-the-net-under-the-rules)) is for "
                 "loops not found yet. The agent before the fix never ended: "
                 "[rendezvous.md](rendezvous.md#the-frozen-agent-before-and-after-the-fix-2026-11-25). torchrun has "
                 "no counterpart: its agent has no lease to lose.", ""]


SIM_SWITCHES = {"old-departures": "departures read without incarnations (before issue 26)",
                "old-store": "the store and ring watcher before issue 26: lease ids from 1 again after an empty "
                             "restart, evictions that do not check the lease still holds the registration",
                "broken-fence": "agents that never fence themselves (broken on purpose)"}


def md_sim(a, S):
    md = ["## 14. Deterministic simulation (issue 27)", ""]
    if "not_run" in S:
        return md + [f"Not run: {S['not_run']}.", ""]
    md += [f"`{shown_path(a.sim)}` (what `scripts/sim.sh` builds and runs), 2 threads; what it models, its "
           "invariants and what each finding was: [simulation.md](simulation.md).", "",
           "| seeds | agents | faults per seed | events | violations | seconds | seeds/s |",
           "|---|---|---|---|---|---|---|"]
    for c in S["campaigns"]:
        md.append(f"| {c['start']:,}–{c['start'] + c['seeds'] - 1:,} | {c['agents']} | {c['faults']} | "
                  f"{c['events']:,} | {c['violations']} | {c['seconds']:.1f} | {c['seeds_per_s']} |")
    md += ["", f"With a fix switched off (`--switch X`, seeds 0–{a.sim_switch_seeds - 1}, 4 agents, 200 faults) it "
           "fails at once:", "",
           "| switch | puts back | first failing seed | the checker there | violations |", "|---|---|---|---|---|"]
    for name, x in S["switches"].items():
        f = x["first"]
        said = "`" + f["said"].replace("|", "/").replace("`", "'")[:160] + "`" if f else "–"
        md.append(f"| `{name}` | {SIM_SWITCHES.get(name, name)} | {f['seed'] if f else 'none'} | {said} | "
                  f"{x['violations']} in {x['seeds']} seeds |")
    return md + ["", "The test command runs seeds 0–9,999 in a test of its own "
                 "(`ten_thousand_seeds_of_two_hundred_faults_break_no_invariant`). torchrun, torchft and NVIDIA's "
                 "ft_launcher have no counterpart.", ""]


SLURM_KINDS = {"fsdp-agent": "fsdp-agent, default settings", "fsdp-agent-prewarm": "fsdp-agent `--prewarm`",
               "torchrun": "torchrun, c10d"}


def md_slurm(a, S):
    md = ["## 15. Slurm: a node lost under `srun --no-kill` (issue 29)", ""]
    if "not_run" in S:
        return md + [f"Not run in this run: {S['not_run']}. What it measures: `bench/slurm.py` on the real three-node "
                     "Slurm of `scripts/slurm/`, a node killed under `srun --no-kill`, fsdp-agent beside torchrun "
                     "([slurm.md](slurm.md#measured)).", ""]
    kinds, n = a.slurm_kinds.split(","), S["runs"]
    runs = {k: [x for x in S["results"] if x["kind"] == k] for k in kinds}
    head = ["| " + " | ".join(f"run {i}" for i in range(1, n + 1)) + " |", "|---" * (n + 1) + "|"]
    md += [f"A real three-node Slurm ({S['version']}; `scripts/slurm/start.sh`: three `slurmd` on this machine, each "
           "node in its own UTS and mount namespace, started afresh for each run in a state directory and on ports "
           "of its own), one worker per node, gloo: `srun -N3 --no-kill LAUNCHER --nnodes 2:3 --max-restarts 3 "
           f"tests/py/elastic_worker.py CKPT {S['steps']}`; once the checkpoint passes step 20, node n3 is killed "
           "(`scripts/slurm/kill-node.sh n3`: SIGKILL to its slurmd, step daemon, agent and worker at once). "
           f"`bench/slurm.py --runs {n} --limit {S['limit_s']:g} --kinds {a.slurm_kinds}`. fsdp-agent takes its "
           "rendezvous from Slurm (given only a c10d port, one no other job on this machine holds); torchrun gets "
           "`--rdzv-backend c10d --rdzv-endpoint n1:PORT --rdzv-id $SLURM_JOB_ID`, `is_host` on node 0 only (the "
           "nodes share the loopback).", "",
           "| n3 killed → the group of two's first all-reduce " + head[0], head[1]]
    for k in kinds:
        cells = []
        for x in runs[k]:
            t = x["death_to_allreduce_s"]
            c = f"{t[0]:.2f}–{t[1]:.2f} s" if t else f"never within {S['limit_s']:g} s"
            cells.append(c + (f", exit {x['exit']}" if isinstance(x["exit"], int) else f" ({x['exit']})"))
        md.append(f"| {SLURM_KINDS.get(k, k)} | " + " | ".join(cells) + " |")
    md += ["", "Each time runs from `kill-node.sh`'s end and from its start (the node dies in between: the script "
           "first finds the node's processes by their namespace) to the survivors' first all-reduce in the group of "
           "two (`allreduced ... world=2 t=`). With fsdp-agent the lost node's ring neighbour finds its status port "
           "refused and revokes its lease, and the survivors seal the group of two at once; the rest is the new "
           "workers' start (`import torch`) and gloo's rendezvous, which `--prewarm` takes off. A node that is "
           "frozen or cut off rather than dead does not refuse its port: its lease decides (`keep_alive_ttl`, 5 s by "
           "default).", "",
           "The same runs, step start (`srun` started) → the group of three's first all-reduce (every node's first "
           "`allreduced ... world=3`):", "", "| " + head[0], head[1]]
    for k in kinds:
        md.append(f"| {SLURM_KINDS.get(k, k)} | " + " | ".join(secs(x["start_to_allreduce_s"]) for x in runs[k]) + " |")
    return md + ["", "Earlier figures (before the status-port fallback), pre-emption and requeue: "
                 "[slurm.md](slurm.md#measured).", ""]


MIXED_CASES = {"static-torchrun-0": "static, torchrun on node 0", "static-torchrun-1": "static, torchrun on node 1",
               "c10d-torchrun-host": "c10d, torchrun serves the store",
               "c10d-agent-host": "c10d, fsdp-agent serves the store"}


def md_mixed(a, X):
    md = ["## 16. A job run half under torchrun (issue 32)", "",
          "`bench/mixed.py`, as the mixed-job tests of `tests/tests/compat.rs`: a two-node job on this machine, "
          "`--nnodes 2 --nproc-per-node 1`, one node under torchrun and the other under fsdp-agent; the first "
          f"launcher starts, {X['wait_s']} s later the second, and the clock runs from the second's start to "
          "fsdp-agent's exit.", "",
          "| job | fsdp-agent exits 64 with `the other node runs torchrun…`, after the second node starts |",
          "|---|---|"]
    for name, label in MIXED_CASES.items():
        c = X["cases"].get(name)
        if c is None:
            shown = skipped(a)
        elif c["seconds"] is None:
            shown = f"not within {X['limit_s']:g} s"
        else:
            shown = f"{c['seconds']:.2f} s"
            if c["exit"] != 64 or not c["said"]:
                shown += f", but it exited {c['exit']}" + ("" if c["said"] else " without the line")
        md.append(f"| {label} | {shown} |")
    imp = X["import_torch_s"]
    return md + ["", "fsdp-agent acts on torchrun's first byte (c10d) or first key (static, looked for every "
                 "second); nearly all of each figure is torchrun starting ("
                 + (f"`import torch` alone is {imp:.1f} s here" if imp else "it imports torch first")
                 + "; as a c10d client it first tries to bind the endpoint). torchrun alone with nobody to meet waits "
                 "until its own timeouts.", ""]


def md_trainer_issue31(a, C, Pr):
    md = ["## 17. Trainer (issue 31)", "",
          "fsdp-trainer under `fsdp-agent --standalone`, gloo, one intra-op thread per rank.", "",
          f"**Checkpoints** (`bench/checkpoint.py --worlds {a.ckpt_worlds}{' --tiny' if a.tiny else ''}`): `full`, "
          f"{C['params'] / 1e6:.1f}M parameters ({C['params'] * 12 / 1e6:.0f} MB of state: parameters and both "
          f"AdamW moments), {C['steps']} steps, a save every {C['every']}. `gathered` (`--sharded_checkpoints=0`): the "
          "lead gathers and writes the whole state while every rank waits; `sharded` (the default): each rank's "
          "writer thread writes its shard from the live tensors while it trains on, the next optimizer update waits "
          "until the writer has read them (counted in the pause: the write's time less one forward and backward "
          "pass), and the lead's writer makes the checkpoint "
          "complete as soon as the last shard is there ([trainer.md](trainer.md)). \"Lost to saves\" is the run's "
          "wall time less the run's without checkpoints (run-to-run noise is about a second).", "",
          "| world | save | complete after its step (median) | training paused per save (median) | run wall | "
          "lost to saves | peak RSS per rank (max) |", "|---|---|---|---|---|---|---|"]
    for x in C["rows"]:
        if x["save"] == "none":
            md.append(f"| {x['world']} | none | – | – | {x['wall_s']:.1f} s | – | {x['peak_mib']:.0f} MiB |")
        else:
            md.append(f"| {x['world']} | {x['save']} | {x['complete_s']:.2f} s | {x['paused_s']:.3f} s | "
                      f"{x['wall_s']:.1f} s | {x['lost_s']:.1f} s | {x['peak_mib']:.0f} MiB |")
    sh = {x["world"]: x for x in C["rows"] if x["save"] == "sharded"}
    ga = {x["world"]: x for x in C["rows"] if x["save"] == "gathered"}
    st = {x["world"]: x for x in C["rows"] if x["save"] == "none"}
    ratios = "; ".join(
        f"world {w}: a sharded save is complete in {sh[w]['complete_s'] / ga[w]['complete_s']:.2f}× the gathered "
        f"save's time, its peak {sh[w]['peak_mib'] - st[w]['peak_mib']:+.0f} MiB against the run without saves"
        for w in sorted(sh) if w in ga and w in st and ga[w]["complete_s"])
    md += ["", (f"{ratios}. " if ratios else "") + "A sharded save holds one 16 MiB chunk of host memory beside the model (no copy of the "
           "shard), so its peak is the steady state's within the run-to-run noise.", ""]
    runs = Pr["runs"]
    params = next((v["params"] for v in runs.values() if v["params"]), 0)
    md += [f"**Mixed precision** (`bench/precision.py{' --tiny' if a.tiny else ''}`: `--bf16=1` against fp32): "
           f"{Pr['model']}, {params / 1e6:.1f}M parameters, world {Pr['world']}, {Pr['steps']} steps, the last three "
           "logged speeds; PyTorch FSDP2 with `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` "
           "(`bench/fsdp2_baseline.py --bf16 1`) on the same model; `fsdp-agent --standalone --nproc-per-node 2 "
           "--no-python` for all.", "",
           "| | fp32 samples/s | bf16 samples/s | fp32 peak RSS per rank | bf16 peak RSS per rank |",
           "|---|---|---|---|---|"]
    for name, label in [("fsdp-trainer full", "fsdp-trainer `full`"), ("fsdp-trainer no_shard", "fsdp-trainer "
                        "`no_shard`"), ("PyTorch FSDP2", "PyTorch FSDP2")]:
        f32, b16 = runs.get(name + " fp32"), runs.get(name + " bf16")
        if f32 is None or b16 is None:
            md.append(f"| {label} | {skipped(a)} | | | |")
            continue
        md.append(f"| {label} | {span(f32['samples_per_s'])} | {span(b16['samples_per_s'])} | "
                  f"{f32['peak_mib']:.0f} MiB | {b16['peak_mib']:.0f} MiB |")
    med = {k: statistics.median(v["samples_per_s"]) for k, v in runs.items() if v["samples_per_s"]}
    said = [f"bf16 runs fsdp-trainer `full` at {med['fsdp-trainer full bf16'] / med['fsdp-trainer full fp32']:.2f}× "
            "its fp32 speed"]
    if "PyTorch FSDP2 fp32" in med and "PyTorch FSDP2 bf16" in med:
        said.append(f"FSDP2 at {med['PyTorch FSDP2 bf16'] / med['PyTorch FSDP2 fp32']:.2f}×; fsdp-trainer `full` "
                    f"runs at {med['fsdp-trainer full fp32'] / med['PyTorch FSDP2 fp32']:.2f}× FSDP2's speed in fp32 "
                    f"and {med['fsdp-trainer full bf16'] / med['PyTorch FSDP2 bf16']:.2f}× in bf16, with "
                    f"{runs['fsdp-trainer full fp32']['peak_mib'] / runs['PyTorch FSDP2 fp32']['peak_mib']:.2f}× its "
                    "peak memory per rank in fp32")
    return md + ["", "; ".join(said) + f". bf16's losses stay within {Pr['loss_max_rel_diff'] * 100:.3f}% of fp32's "
                 f"over {Pr['loss_steps']} steps of the trainer's default model under `full` "
                 "(`trainer/tests/seed_flags.rs` allows 1%).", ""]


def md_goodput(a, G):
    md = ["## 18. Goodput: what a lost node costs the job", "",
          f"`bench/goodput.py{' --tiny' if a.tiny else f' --minutes {a.goodput_minutes}'}`: three pods "
          f"(`--nnodes 2:3`, one worker each, as in §3–5), {G['minutes']} minutes per launcher, the same seeded "
          f"schedule for each (seed {G['seed']}): a pod SIGKILLed, back, another SIGTERMed (a pod delete), back, "
          f"again, an event every {G['interval_s']:.0f} s ±20%; pod 0 (torchrun's c10d store host) is never "
          f"touched. A checkpoint every {G['checkpoint_freq']} steps. The **stall** of an event runs from it (or "
          "from the furthest step reached before the group paused, for a return) to the first step beyond that "
          "step; goodput = 1 − Σ stalls / wall, from the first step to the end. `torchrun-dcp` and "
          "`fsdp-agent-prewarm` run `bench/goodput_worker.py` (the trainer's model under PyTorch FSDP2 on Gloo, "
          "saving and resuming with DCP); `fsdp-trainer-disk` is the trainer with its own disk checkpoints and no "
          "snapshots; `fsdp-trainer-memory` the trainer with peer-memory snapshots every step and in-place re-form "
          "([goodput](goodput.md#peer-memory-snapshots-and-in-place-re-form)).", "",
          "| launcher | step s | events | goodput | mean stall: loss / return | steps redone | survivors restarted "
          "| modelled goodput, a failure (loss and return) every 60 s / 5 min |", "|---|---|---|---|---|---|---|---|"]
    for r in G["results"]:
        if "error" in r:
            md.append(f"| {r['kind']} | the first group did not form: {r['error']} | | | | | | |")
            continue
        evs = r["events"]
        stuck = next((e for e in evs if "stuck" in e), None)
        mean = lambda xs: f"{statistics.mean(xs):.2f} s" if xs else "–"  # noqa: E731
        ok = [e for e in evs if "stuck" not in e]
        loss = mean([e["stall_s"] for e in ok if e["event"] != "back"])
        back = mean([e["stall_s"] for e in ok if e["event"] == "back"])
        if stuck:
            back += (f" (the {stuck['event']} at {stuck['at_s']:.0f} s did not go through: {stuck['stuck']}; "
                     f"{stuck.get('stall_s', 0):.0f} s without a step to the end)")
        mo = r.get("modelled") or {}
        model = f"{mo['60']:.3f} / {mo['300']:.3f}" if mo else "the job did not survive the schedule"
        md.append(f"| {r['kind']} | {r['step_s']:.3f} | {len(evs)} | **{r['goodput']:.3f}** | {loss} / {back} | "
                  f"{sum(e['redone'] for e in evs)} | {sum(bool(e['survivors_restarted']) for e in evs)} of "
                  f"{len(evs)} | {model} |")
    md += ["", "Where a loss's and a return's stalls go (mean seconds from the stall's start; fsdp-agent's own log "
           "lines for detected and re-formed, the new group's rank 0 for the rest):", "",
           "| launcher | event | detected | re-formed | worker ready | state restored | training | steps redone |",
           "|---|---|---|---|---|---|---|---|"]
    for r in G["results"]:
        for kind, name in (("kill", "SIGKILLed"), ("term", "SIGTERMed (a pod delete)"), ("back", "back")):
            evs = [e for e in r["events"] if "stuck" not in e and e["event"] == kind]
            if not evs:
                continue

            def avg(k, evs=evs):
                xs = [e[k] for e in evs if e.get(k) is not None]
                return f"{statistics.mean(xs):.2f}" if xs else "–"
            md.append(f"| {r['kind']} | {name} | {avg('detected_s')} | {avg('reformed_s')} | {avg('ready_s')} | "
                      f"{avg('restored_s')} | {avg('stall_s')} | {avg('redone')} |")
    return md + ["", "![goodput](bench/goodput.svg)", "",
                 "The plot and the modelled column are arithmetic on the measured stalls: 1 − (a loss's stall + a "
                 "return's) / interval. An event whose change never goes through (no new group within the "
                 "timeout, or every launcher gone) ends that launcher's schedule; the time from it, or from the "
                 "last step after it, to the end counts as stalled. torchrun's recovery goes through its workers' "
                 "failure and a restart, whose workers can wait on a peer that never comes (§3–5's \"never\" "
                 "rows), and it does not grow a running group. fsdp-trainer with a `--checkpoint_dir` is warned "
                 "rather than stopped when the group grows or its node is deleted, so those events redo no step "
                 "([supervision](supervision.md#signals)). What the stalls would be on a real job is in "
                 "[goodput.md](goodput.md).",
                 ""]


def md_stragglers(a, S):
    md = ["## 19. Stragglers: a slow node named, and replaced", ""]
    if "not_run" in S:
        return md + [f"Not run: {S['not_run']}.", ""]
    md += ["`bench/stragglers.py`: four pods (`--nnodes 3:4`, one fsdp-trainer worker each, the demo's model, "
           "peer-memory snapshots every step, so survivors re-form in place) and a fifth waiting as a spare. After "
           "40 s of training, pod 2's worker is moved into a CPU cgroup whose quota is half the CPU it was using "
           "(measured over 5 s): slowed by the kernel, not by a flag. The group's rank 0 judges every 5 s "
           "([failure-policy](failure-policy.md#stragglers---straggler-policy-warnreplace)). Step rates are "
           "the job's steps per second; goodput = steps from the slowdown to the end over the healthy rate times "
           "that time (100 s).", "",
           "| policy | healthy rate | worker's CPU → quota | named after | slowed rate | taken out after naming "
           "| rate after | within 10% of healthy after naming | goodput |", "|---|---|---|---|---|---|---|---|---|"]
    for r in S["results"]:
        out = f"{r['taken_out_after_s']:.0f} s" if r.get("taken_out_after_s") is not None else "–"
        after = f"{r['after_rate']:.2f}/s" if r.get("after_rate") is not None else "–"
        back = f"{r['back_within_10pct_s']:.0f} s" if r.get("back_within_10pct_s") is not None else "not within the run"
        md.append(f"| `{r['policy']}` | {r['healthy_rate']:.2f}/s | {r['worker_cpu_cores']:.2f} → "
                  f"{r['quota_cores']:.2f} cores | {r['named_after_s']:.1f} s, {r['named_after_steps']} steps | "
                  f"{r['slowed_rate']:.2f}/s | {out} | {after} | {back} | **{r['goodput']:.3f}** |")
    return md + ["", "With `replace` the node is taken out 20 s after it is named (the bound that lets noise clear "
                 "first), its agent leaves at its next look (1 s) and the survivors re-form in place with the spare: "
                 "no restart, no reload. With `warn` nothing is taken out and the job runs at the slow node's pace "
                 "to the end.", ""]


def md_reproduce(a, took):
    md = ["## Reproduce", "", "```",
          f"scripts/bench.sh           # everything, about {sum(s[1] for s in STEPS.values()):.0f} minutes on 2 cores",
          "python bench/suite.py --tiny --out /tmp/r   # the smoke test's tiny version",
          "python bench/suite.py --only prewarm,sim   # some steps: their results as JSON, nothing written", "```", "",
          "The steps of a full run: what each runs, its estimate on 2 cores (from the scripts' own run lengths) and "
          "what it took in this run:", "",
          "| step | runs | estimate, min | this run, min |", "|---|---|---|---|"]
    for k, (_, est, what) in STEPS.items():
        md.append(f"| {k} | {what} | {est:g} | {took[k] / 60:.1f} |")
    return md + ["", "Raw results of this run: [bench/results.json](bench/results.json).", ""]


def report(a, m, r, took, elapsed):
    figs = os.path.join(a.out, "bench")
    os.makedirs(figs, exist_ok=True)
    md = ["# Benchmarks", "",
          "Generated, whole, by one run of `scripts/bench.sh` (it builds the release binaries and runs",
          "`bench/suite.py`) on the machine below: edit `bench/suite.py`, not this file or the plots in `docs/bench/`.",
          "Wherever torchrun has a counterpart it is measured side by side, from the same PyTorch venv.", "",
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
        row = [ELASTIC_DESC.get(s, s)]
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
           f"growing N once a size takes more than {a.torch_rdzv_stop:.0f} s. The etcd floor is what no "
           "protocol goes below on this etcd and machine: each node only grants a lease, puts one key on it, "
           "opens a watch and a keep-alive stream and renews once, at most 500 nodes under way at a time "
           "(`rdzv-bench --nodes N --ceiling`, one run).", "",
           "| N | fsdp-agent s | etcd floor s | etcd writes per node | torch etcd-v2 s | ratio |",
           "|---|---|---|---|---|---|"]
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
        floor = R.get("etcd floor", {}).get(n)
        md.append(f"| {n} | {cell(o, '{:.3f}') if n in R['fsdp-agent'] else '–'} | "
                  f"{f'{floor:.3f}' if floor is not None else '–'} | {f'{w:.2f}' if w else '–'} | "
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
    md += md_goodput(a, r["goodput"])
    md += md_stragglers(a, r["stragglers"])
    md += md_reproduce(a, took)
    with open(os.path.join(figs, "results.json"), "w") as f:
        json.dump({"machine": m, "results": r, "minutes": {k: v / 60 for k, v in took.items()}}, f, indent=1,
                  default=str)
    with open(os.path.join(a.out, "benchmarks.md"), "w") as f:
        f.write("\n".join(md))


# Every step of a full run, in order: its function, its estimate on 2 cores (minutes, from
# the scripts' own run lengths; scripts/bench.sh's header repeats them) and what it runs.
STEPS = {
    "launch": (bench_launch, 1, "fsdp-agent and torchrun `--standalone --no-python /bin/true`, N = 1, 2, 8, 5 runs"),
    "idle": (bench_idle, 1, "8 idle workers for 10 s under each launcher, 3 runs"),
    "elastic": (bench_elastic, 12, "`bench/elastic.py`: 5 scenarios × 4 launchers, 2–3 runs"),
    "rendezvous": (bench_rendezvous, 3, "`rdzv-bench` at 8–1,000 nodes (form, leave, kill), `bench/torch_rdzv.py` "
                                        "to 64"),
    "agents_scale": (bench_agents_scale, 1, "`bench/agents_scale.py --nodes 256`, SIGTERM and SIGKILL"),
    "trainer": (bench_trainer, 3, "`bench/trainer.py --runs 3`"),
    "hangs": (bench_hangs, 2, "`bench/hangs.py --timeout 60`"),
    "demo": (bench_demo, 1.5, "`bench/demo.py --steps 800` (the demo of `scripts/demo.sh`)"),
    "full_shard": (bench_full_shard, 11, "`bench/full_shard.py --runs 2 --budget-mib 1024`"),
    "prewarm": (bench_prewarm, 7, "`bench/prewarm.py --runs 2 --timeout 35`, 3 scenarios × 3 launchers"),
    "livelock": (bench_livelock, 1.5, "`bench/livelock.py --runs 3 --limit 60`"),
    "sim": (bench_sim, 2.5, "the simulator: 29,000 seeds in 4 campaigns, each fix switched off"),
    "slurm": (bench_slurm, 6.5, "`bench/slurm.py --runs 3 --limit 90` on the three-node Slurm of `scripts/slurm/`"),
    "mixed": (bench_mixed, 0.5, "`bench/mixed.py`: 4 mixed jobs"),
    "checkpoint": (bench_checkpoint, 2.5, "`bench/checkpoint.py --worlds 2,4`"),
    "precision": (bench_precision, 3.5, "`bench/precision.py`: 6 runs of 4 steps, 2 of 100"),
    "goodput": (bench_goodput, 17, "`bench/goodput.py --minutes 4`: 4 launchers through one schedule"),
    "stragglers": (bench_stragglers, 7, "`bench/stragglers.py`: a node slowed by a cgroup, `replace` and `warn`"),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "docs"))
    ap.add_argument("--runs", type=int, default=5, help="runs of the quick benchmarks")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--agent", default=os.path.join(ROOT, "target/release/fsdp-agent"))
    ap.add_argument("--trainer", default=os.path.join(ROOT, "target/release/fsdp-trainer"))
    ap.add_argument("--rdzv-bench", dest="rdzv_bench", default=os.path.join(ROOT, "target/release/rdzv-bench"))
    ap.add_argument("--sim", help="the simulator (default: examples/sim beside --agent, as cargo builds it)")
    ap.add_argument("--only", help="these steps only (default: all): their results as JSON, no report")
    a = ap.parse_args()
    only = (a.only or ",".join(STEPS)).split(",")
    a.steps = only
    # The smoke test (--tiny, every step) starts no Slurm cluster; --tiny --only slurm does.
    a.slurm_asked = a.only is not None and "slurm" in only
    a.sim = a.sim or os.path.join(os.path.dirname(a.agent), "examples", "sim")
    if a.tiny:
        a.runs, a.runs_slow, a.nprocs = 1, 1, [1]
        a.idle_workers, a.idle_seconds = 2, 1
        a.elastic_plan, a.elastic_kinds, a.elastic_timeout = [("startup-2", 1)], "fsdp-agent,torchrun-c10d", 40
        a.rdzv_nodes, a.torch_nodes, a.torch_rdzv_timeout, a.torch_rdzv_stop = [8], [4], 60, 30
        a.scale_nodes, a.scale_hows, a.scale_idle = [4], ["kill"], 0
        # No stall under --tiny: two starts of torch workers are most of the step's time.
        a.hang_timeout, a.hang_seconds, a.hang_kinds = 30, 1, ""
        a.demo_steps = 40
        a.runs_shard, a.budget_mib = 1, 400
        a.runs_prewarm, a.prewarm_timeout, a.prewarm_scenarios = 1, 30, "reform-TERM"
        a.prewarm_kinds = "fsdp-agent-prewarm"
        a.prewarm_settle, a.spare_wait = 3, 0
        a.livelock_limit, a.livelock_freeze, a.livelock_work = 30, 4, 1
        a.sim_campaigns, a.sim_switch_seeds = [(20, 0, 4, 200)], 20
        a.runs_slurm, a.slurm_kinds, a.slurm_limit, a.slurm_steps = 1, "fsdp-agent", 60, 60
        a.mixed_cases, a.import_runs = "c10d-torchrun-host", 0
        a.ckpt_worlds = "2"
        # torchrun's part takes minutes even tiny (its worker's 30 s Gloo bound, then a stuck return).
        a.goodput_kinds = "fsdp-trainer-memory,fsdp-agent-prewarm"
    else:
        a.runs_slow, a.nprocs = 3, [1, 2, 8]
        a.idle_workers, a.idle_seconds = 8, 10
        a.elastic_plan = [("startup-2,startup-4", 3), ("reform-TERM,reform-KILL,scaleup-3", 2)]
        a.elastic_kinds, a.elastic_timeout = "fsdp-agent,fsdp-agent-c10d,torchrun-c10d,torchrun-etcd-v2", 40
        a.rdzv_nodes, a.torch_nodes, a.torch_rdzv_timeout, a.torch_rdzv_stop = [8, 64, 256, 1000], [8, 16, 32, 64, 128], 90, 10
        # Real agents at a moderate N; 1,000 and the history are in docs/bench/agents-scale.md.
        a.scale_nodes, a.scale_hows, a.scale_idle = [256], ["term", "kill"], 5
        # torchrun cannot recover from a stall before gloo's 30 minutes: a minute shows it.
        a.hang_timeout, a.hang_seconds, a.hang_kinds = 60, 10, "fsdp-agent,torchrun"
        a.demo_steps = 800
        a.runs_shard, a.budget_mib = 2, 1024
        # torchrun etcd-v2's recovery is §3–5's already; here torchrun c10d stands for it.
        a.runs_prewarm, a.prewarm_timeout, a.prewarm_scenarios = 2, 35, "reform-TERM,crash,startup-3"
        a.prewarm_kinds, a.prewarm_settle, a.spare_wait = "fsdp-agent-prewarm,fsdp-agent,torchrun-c10d", 10, 15
        a.livelock_limit, a.livelock_freeze, a.livelock_work = 60, 8, 20
        # (seeds, first seed, agents, faults per seed)
        a.sim_campaigns = [(10000, 0, 4, 200), (10000, 10000, 3, 200), (5000, 100000, 5, 200), (4000, 50000, 6, 300)]
        a.sim_switch_seeds = 100
        a.runs_slurm, a.slurm_kinds, a.slurm_limit, a.slurm_steps = 3, "fsdp-agent,fsdp-agent-prewarm,torchrun", 90, 300
        a.mixed_cases, a.import_runs = "static-torchrun-0,static-torchrun-1,c10d-torchrun-host,c10d-agent-host", 3
        a.ckpt_worlds = "2,4"
        a.goodput_kinds, a.goodput_minutes = "torchrun-dcp,fsdp-agent-prewarm,fsdp-trainer-disk,fsdp-trainer-memory", 4
    unknown = [k for k in only if k not in STEPS]
    if unknown:
        sys.exit(f"bench: no step {', '.join(unknown)}; the steps: {', '.join(STEPS)}")
    need = [a.agent, a.rdzv_bench, a.trainer, TORCHRUN] + ([a.sim] if "sim" in only and not a.tiny else [])
    for p in need:
        if not os.path.exists(p):
            sys.exit(f"bench: {p} is missing; run scripts/bench.sh (it builds the release binaries)")
    # Everything the steps leave in temporary directories (the agents' log directories,
    # torchrun's, the scripts' own, the Slurm cluster's state) goes under one, removed at the end.
    work = tempfile.mkdtemp(prefix="fsdp-bench-")
    os.environ["TMPDIR"] = QUIET["TMPDIR"] = tempfile.tempdir = work
    try:
        t0 = time.monotonic()
        m = machine()
        log(f"machine: {m}")
        results, took = {}, {}
        for k in only:
            t = time.monotonic()
            results[k] = STEPS[k][0](a)
            took[k] = time.monotonic() - t
            log(f"{k}: {took[k] / 60:.1f} min")
        if set(results) == set(STEPS):
            report(a, m, results, took, time.monotonic() - t0)
            log(f"wrote {os.path.join(a.out, 'benchmarks.md')} in {(time.monotonic() - t0) / 60:.1f} min")
        else:
            print(json.dumps(results, indent=1, default=str))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
