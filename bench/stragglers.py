"""Stragglers: a node slowed for real, named, and (with --straggler-policy replace) taken
out and replaced by a spare.

Four pods (as bench/elastic.py makes them: each in its own PID+UTS namespace, so each its
own machine name) train fsdp-trainer with peer-memory snapshots (--snapshot_freq 1: the
survivors re-form in place), --nnodes 3:4, and a fifth pod waits as a spare. After
--healthy seconds of training, pod 2's worker is slowed by the kernel: moved into a CPU
cgroup whose quota is half the CPU it was using (measured over 5 s first), not a flag in
the worker. Measured:

  named after     seconds and steps from the slowdown to the judge's "a straggler:" line
  step rate       steps per second: healthy (before the slowdown), slowed (from the
                  slowdown to the take-out, or to the end with warn), after (from the spare's
                  first step in the group to the end)
  back within     seconds from the naming until the step rate over a 10 s window is within
                  10% of the healthy rate again
  goodput         steps done from the slowdown to the end / (healthy rate x that time)

Each policy in turn (replace, then warn), same schedule. With --healthy-minutes M it runs
instead M minutes of four healthy pods and counts the nodes named (there must be none;
run it with the machine loaded).

usage: python bench/stragglers.py [--agent target/release/fsdp-agent] [--trainer target/release/fsdp-trainer]
                                  [--healthy 40] [--after 100] [--policies replace,warn]
                                  [--healthy-minutes M] [--json F] [--keep]
Needs: etcd on PATH, unshare, root (the cgroup), torch in this interpreter's environment.
"""
import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import elastic  # noqa: E402
from goodput import MODEL, Lines  # noqa: E402

NAMED = re.compile(r"a straggler: node (\S+):")
TAKEN_OUT = re.compile(r"taking the straggler out")
FORMED = re.compile(r"group formed")


def launcher(a, endpoint, run_id, index, ckpt, policy):
    addr = f"127.0.{10 + index}.1"
    return [a.agent, "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--nnodes", "3:4", "--nproc-per-node", "1", "--local-addr", addr, "--rdzv-conf",
            "last_call_timeout=1", "--max-restarts", "100", "--term-timeout", "5",
            "--straggler-policy", policy, "--quarantine-for", "10m",
            "--no-python", a.trainer, "--max_steps", "1000000", "--logging_freq", "1",
            "--checkpoint_freq", "200", "--checkpoint_dir", ckpt, "--resume_from_checkpoint", ckpt,
            "--snapshot_freq", "1"] + MODEL


def trainer_pid(pod):
    """The fsdp-trainer process in a pod (a descendant of its launcher)."""
    for pid in elastic.descendants(pod.proc.pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "fsdp-trainer":
                    return pid
        except OSError:
            pass
    return None


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Cgroup:
    """A CPU cgroup at `cores` of a core (cgroup v1's cpu controller, or v2's cpu.max)."""

    def __init__(self, cores):
        period = 20_000
        quota = max(1_000, int(period * cores))
        name = f"bench-straggler-{os.getpid()}"
        v1 = "/sys/fs/cgroup/cpu"
        if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
            self.dir = os.path.join(v1, name)
            os.makedirs(self.dir, exist_ok=True)
            open(os.path.join(self.dir, "cpu.cfs_period_us"), "w").write(str(period))
            open(os.path.join(self.dir, "cpu.cfs_quota_us"), "w").write(str(quota))
        else:
            self.dir = os.path.join("/sys/fs/cgroup", name)
            os.makedirs(self.dir, exist_ok=True)
            open(os.path.join(self.dir, "cpu.max"), "w").write(f"{quota} {period}")
        self.quota_cores = quota / period

    def take(self, pid):
        open(os.path.join(self.dir, "cgroup.procs"), "w").write(str(pid))

    def remove(self):
        for _ in range(100):
            try:
                os.rmdir(self.dir)
                return
            except OSError:
                time.sleep(0.05)


def rate(steps, t0, t1):
    """Steps per second read in [t0, t1)."""
    n = [s for t, s, _ in steps if t0 <= t < t1]
    return (max(n) - min(n)) / (t1 - t0) if len(n) > 1 and t1 > t0 else 0.0


def run(a, policy, workdir):
    d = tempfile.mkdtemp(prefix=f"{policy}-", dir=workdir)
    ckpt = os.path.join(d, "ckpt")
    os.makedirs(ckpt)
    etcd = elastic.Etcd(v2=False)
    env = elastic.pod_env()
    env["TMPDIR"] = d
    lines, pods, cg = Lines(), {}, None
    run_id = f"s{time.monotonic_ns()}"

    def start(i):
        pods[i] = elastic.Pod(f"pod{i}", launcher(a, f"127.0.0.1:{etcd.port}", run_id, i, ckpt, policy), d, env)
        lines.follow(i, pods[i].out_path)

    def wait(cond, limit, what):
        end = time.monotonic() + limit
        while time.monotonic() < end:
            lines.pump()
            v = cond()
            if v:
                return v
            time.sleep(0.05)
        raise RuntimeError(f"{policy}: {what} not within {limit} s; logs in {d}")

    try:
        for i in range(4):
            start(i)
        wait(lambda: all(trainer_pid(pods[i]) for i in range(4)) and lines.after(-1, re.compile(r"^Model: .*world size 4\b")),
             180, "a group of 4")
        start(4)  # the spare: the group is at its maximum
        t_first = wait(lambda: lines.steps() and lines.steps()[0][0], 120, "the first step")
        if a.healthy_minutes:
            end = time.monotonic() + a.healthy_minutes * 60
            wait(lambda: time.monotonic() >= end, a.healthy_minutes * 60 + 10, "the end")
            named = [l for _, _, l in lines.seen if NAMED.search(l)]
            steps = lines.steps()
            return {"policy": policy, "healthy_minutes": a.healthy_minutes, "named": len(named),
                    "named_lines": named[:5], "steps": max(s for _, s, _ in steps),
                    "step_rate": round(rate(steps, t_first + 10, time.monotonic()), 3)}
        t_slow = t_first + a.healthy
        wait(lambda: time.monotonic() >= t_slow, a.healthy + 10, "the healthy stretch")
        healthy = rate(lines.steps(), t_first + 10, t_slow)
        pid = trainer_pid(pods[2])
        c0, w0 = cpu_seconds(pid), time.monotonic()
        time.sleep(5)
        used = (cpu_seconds(pid) - c0) / (time.monotonic() - w0)
        cg = Cgroup(used / 2)
        cg.take(pid)
        t_slow = time.monotonic()
        lines.pump()
        step_at_slow = max(s for _, s, _ in lines.steps())
        t_end = t_slow + a.after
        named = wait(lambda: lines.after(t_slow, NAMED), a.after, "the naming")
        t_named = named[0]
        step_at_named = max(s for _, s, _ in lines.steps(before=t_named))
        taken = None
        if policy == "replace":
            taken = wait(lambda: lines.after(t_named, TAKEN_OUT), 90, "the take-out")[0]
            wait(lambda: pods[2].proc.poll() is not None, 60, "the slowed pod's exit")
        wait(lambda: time.monotonic() >= t_end, a.after + 10, "the end")
        steps = lines.steps()
        slowed = rate(steps, t_slow, taken or t_end)
        joined = lines.after(taken, FORMED, [4]) if taken else None
        after = rate(steps, joined[0] + 5, t_end) if joined else None
        back = None
        t = t_named
        while t + 10 <= t_end:
            if rate(steps, t, t + 10) >= 0.9 * healthy:
                back = round(t + 10 - t_named, 1)
                break
            t += 1
        done = max(s for _, s, _ in steps) - step_at_slow
        return {"policy": policy, "healthy_rate": round(healthy, 3), "worker_cpu_cores": round(used, 3),
                "quota_cores": round(cg.quota_cores, 3), "named_after_s": round(t_named - t_slow, 1),
                "named_after_steps": step_at_named - step_at_slow, "named": NAMED.search(named[2]).group(1),
                "named_the_slowed_pod": NAMED.search(named[2]).group(1).startswith("pod2-"),
                "slowed_rate": round(slowed, 3), "taken_out_after_s": round(taken - t_named, 1) if taken else None,
                "after_rate": round(after, 3) if after is not None else None,
                "back_within_10pct_s": back, "goodput": round(done / (healthy * (t_end - t_slow)), 3),
                "window_s": round(t_end - t_slow, 1)}
    finally:
        for p in pods.values():
            p.kill()
        if cg:
            cg.remove()
        etcd.stop()
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--agent", default=os.path.join(ROOT, "target/release/fsdp-agent"))
    p.add_argument("--trainer", default=os.path.join(ROOT, "target/release/fsdp-trainer"))
    p.add_argument("--healthy", type=float, default=40, help="seconds of healthy training before the slowdown")
    p.add_argument("--after", type=float, default=100, help="seconds measured after the slowdown")
    p.add_argument("--policies", default="replace,warn")
    p.add_argument("--healthy-minutes", type=float, default=0)
    p.add_argument("--json")
    p.add_argument("--keep", action="store_true")
    a = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench-stragglers-")
    results = []
    try:
        policies = ["warn"] if a.healthy_minutes else a.policies.split(",")
        for policy in policies:
            r = run(a, policy, workdir)
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": f"{os.cpu_count()} cores", "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
