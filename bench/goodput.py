"""Goodput: the share of wall time a job makes progress while nodes die and come back.

Three pods (as bench/elastic.py makes them: a launcher in its own PID+UTS namespace, so a
SIGKILL of the pod kills everything in it) train one model, --nnodes 2:3. A seeded schedule
of events runs for --minutes: a pod SIGKILLed, the same pod back, another pod SIGTERMed (a
pod delete), that pod back, and again. Pod 0 is never touched: it hosts torchrun's c10d
store, and torchrun is measured on its recovery path, not on its single point of failure.

Side by side in one run, each launcher with the same schedule:
  torchrun-dcp          torchrun (c10d), bench/goodput_worker.py: FSDP2, DCP every N steps
  fsdp-agent-prewarm    fsdp-agent --prewarm (etcd), the same script
  fsdp-trainer-disk     fsdp-agent (etcd), fsdp-trainer with its disk checkpoints every N steps
                        (--snapshot_freq 0: workers restarted on every change, as before)
  fsdp-trainer-memory   fsdp-agent (etcd), fsdp-trainer with peer-memory snapshots every step:
                        the survivors re-form in place (same processes) and rebuild the
                        newest step from memory; the disk checkpoints stay as the fallback

Per event: the **stall**, from the event (or from the furthest step the job reached
before the new group paused it, when that came later: a node coming back pauses nobody
until its launcher is admitted) to the first step beyond that furthest step; the steps
redone; the stall's parts, each as seconds from the stall's start: detected (fsdp-agent's
"group changed"), re-formed ("group formed"), worker ready (the new group's rank 0 says
`Model:`), state restored (`Loaded checkpoint`), training (the first step beyond); whether
the survivors' workers were restarted; and the loss's jump (the first loss after the
event against the last before). Goodput = 1 - sum of stalls / wall, the wall counted from
the group's first step to the end.

From the mean stall of a loss and of a return it also models a failure (a loss and its
return) every 30 s to 10 min: goodput = 1 - (stall of a loss + stall of a return) /
interval. That is arithmetic on measured stalls, said so where it is printed.

Lines are stamped when this script reads them (it polls every 20 ms).

usage: python bench/goodput.py [--agent target/release/fsdp-agent] [--trainer target/release/fsdp-trainer]
                               [--minutes 3] [--interval 20] [--seed 1] [--kinds K,...] [--json F] [--svg F]
                               [--tiny]
Needs: etcd on PATH, unshare, root, torch in this interpreter's environment.
"""
import argparse
import bisect
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import elastic  # noqa: E402  (its Etcd, Pod and pod environment)
import svg  # noqa: E402

WORKER = os.path.join(HERE, "goodput_worker.py")
KINDS = ["torchrun-dcp", "fsdp-agent-prewarm", "fsdp-trainer-disk", "fsdp-trainer-memory"]
# The demo's model (scripts/demo/elastic.py): big enough to watch, small enough for any machine.
MODEL = ["--hidden_width", "128", "--num_layers", "4", "--intermediate_size", "344", "--num_heads", "8",
         "--num_key_value_heads", "4", "--max_context_width", "64", "--threads", "1"]
PREWARM_MODULES = "torch,torch.distributed.checkpoint,torch.distributed.fsdp,torch.nn.functional"
BATCH = re.compile(r"Batch (\d+) Loss: ([0-9.]+)")
READY = re.compile(r"^Model: ")
WORLD_OF_3 = re.compile(r"^Model: .*world size 3\b")
RESTORED = re.compile(r"Loaded checkpoint|Restored step")
DETECTED = re.compile(r"group changed; re-forming|how the lost member was noticed")
FORMED = re.compile(r"group formed")
STARTED = re.compile(r"workers started")
POLL = 0.02
MODEL_INTERVALS = [30, 60, 120, 300, 600]


class Lines:
    """Every line of every pod's output, stamped when read: (t, pod index, line)."""

    def __init__(self):
        self.files = []  # [pod index, path, offset, partial]
        self.seen = []
        # The step lines, parsed once as they come: (t, step from 1, loss). The waits look
        # at them every poll, on the cores the training runs on.
        self.batches = []

    def follow(self, index, path):
        self.files.append([index, path, 0, ""])

    def pump(self):
        now = time.monotonic()
        for f in self.files:
            try:
                with open(f[1], errors="replace") as h:
                    h.seek(f[2])
                    text = h.read()
                    f[2] = h.tell()
            except OSError:
                continue
            text = f[3] + text
            *done, f[3] = text.split("\n")
            for line in done:
                m = BATCH.search(line)
                if m:
                    self.batches.append((now, int(m.group(1)) + 1, float(m.group(2))))
                else:
                    self.seen.append((now, f[0], line))

    def after(self, t, pattern, pods=None):
        """The first (t, pod, line) read after `t` matching `pattern`, or None. The lines are
        stamped in the order read, so the look starts at `t`, not at the run's first line."""
        start = bisect.bisect_right(self.seen, t, key=lambda x: x[0])
        return next(((u, p, l) for u, p, l in self.seen[start:] if pattern.search(l)
                     and (pods is None or p in pods)), None)

    def steps(self, after=-1.0, before=float("inf")):
        """[(t, step, loss)] read in (after, before); step counts from 1."""
        lo = bisect.bisect_right(self.batches, after, key=lambda x: x[0])
        hi = bisect.bisect_left(self.batches, before, key=lambda x: x[0])
        return self.batches[lo:hi]


def launcher(kind, a, endpoint, run_id, index, ckpt):
    addr = f"127.0.{10 + index}.1"
    script = [WORKER, "--checkpoint_dir", ckpt, "--checkpoint_freq", str(a.checkpoint_freq)] + MODEL
    if kind == "torchrun-dcp":
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        # torchrun recovers from a peer's death by restarting its workers: a budget large
        # enough for the whole schedule (membership changes do not spend it).
        return [torchrun, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                "--nnodes", "2:3", "--nproc-per-node", "1", "--local-addr", addr, "--max-restarts", "1000",
                "--rdzv-conf", f"last_call_timeout=1,is_host={1 if index == 0 else 0}",
                "--monitor-interval", "0.1"] + script
    agent = [a.agent, "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
             "--nnodes", "2:3", "--nproc-per-node", "1", "--local-addr", addr, "--rdzv-conf",
             "last_call_timeout=1", "--max-restarts", "1000", "--term-timeout", "5"]
    if kind == "fsdp-agent-prewarm":
        # Its spares import what the script imports, so a start waits for none of it.
        return agent + ["--prewarm", "--prewarm-modules", PREWARM_MODULES] + script
    snapshots = ["--snapshot_freq", "1" if kind == "fsdp-trainer-memory" else "0"]
    return agent + ["--no-python", a.trainer, "--max_steps", "1000000", "--logging_freq", "1",
                    "--checkpoint_freq", str(a.checkpoint_freq), "--checkpoint_dir", ckpt,
                    "--resume_from_checkpoint", ckpt] + snapshots + MODEL


def worker_pids(pod):
    """The pids of the training processes in a torchrun pod (its workers' command lines
    name the script; the launcher's does too, so it is left out)."""
    out = set()
    for pid in elastic.descendants(pod.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(b"goodput_worker.py" in x for x in argv) and not any(os.path.basename(x) == b"torchrun" for x in argv):
            out.add(pid)
    return out


class Stuck(Exception):
    """The job did not get past an event: no new group within --timeout, or every launcher exited."""


class Run:
    """One launcher through the whole schedule."""

    def __init__(self, kind, a, workdir):
        self.kind, self.a = kind, a
        self.dir = tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir)
        self.ckpt = os.path.join(self.dir, "ckpt")
        os.makedirs(self.ckpt)
        self.etcd = None if kind == "torchrun-dcp" else elastic.Etcd(v2=False)
        self.endpoint = (f"127.0.10.1:{elastic.free_port()}" if self.etcd is None
                         else f"127.0.0.1:{self.etcd.port}")
        self.run_id = f"g{time.monotonic_ns()}"
        self.env = elastic.pod_env()
        # The agents' log directories and progress sockets go under this run's directory,
        # removed with it.
        self.env["TMPDIR"] = self.dir
        if a.keep:
            self.env["LOGLEVEL"] = "INFO"
        self.lines = Lines()
        self.pods = {}
        # Pods taken out by the schedule, killed at the end in case they still run.
        self.gone = []
        self.events = []

    def start(self, i):
        pod = elastic.Pod(f"pod{i}", launcher(self.kind, self.a, self.endpoint, self.run_id, i, self.ckpt),
                          self.dir, self.env)
        self.pods[i] = pod
        self.lines.follow(i, pod.out_path)

    def wait(self, what, cond, limit):
        end = time.monotonic() + limit
        while time.monotonic() < end:
            self.lines.pump()
            v = cond()
            if v:
                return v
            if self.pods and all(p.proc.poll() is not None for p in self.pods.values()):
                raise Stuck(f"every launcher exited while waiting for {what}")
            time.sleep(POLL)
        raise Stuck(f"{what} not within {limit:.0f} s")

    def restarted(self, survivors, t, before):
        if self.kind == "torchrun-dcp":
            return any(worker_pids(self.pods[i]) != before.get(i) for i in survivors)
        return self.lines.after(t, STARTED, survivors) is not None

    def event(self, what, index):
        """Does `what` (kill, term, back) to pod `index` and measures until training is
        past where it was."""
        self.lines.pump()
        survivors = [i for i in self.pods if i != index]
        before = {i: worker_pids(self.pods[i]) for i in survivors} if self.kind == "torchrun-dcp" else {}
        t_e = time.monotonic()
        if what == "kill":
            self.gone.append(self.pods.pop(index))
            self.gone[-1].kill()
        elif what == "term":
            pod = self.pods.pop(index)
            self.gone.append(pod)
            pod.term()
        else:
            self.start(index)
        try:
            ready = self.wait("a new group", lambda: self.lines.after(t_e, READY), self.a.timeout)[0]
            done = self.lines.steps(before=ready)
            furthest = max((s for _, s, _ in done), default=0)
            t_f = max((t for t, s, _ in done if s == furthest), default=t_e)
            beyond = self.wait("a step beyond the furthest",
                               lambda: next(((t, s, l) for t, s, l in self.lines.steps(after=ready)
                                             if s > furthest), None), self.a.timeout)
        except Stuck as e:
            # The rest of the planned run is lost: the stall lasts to its end (see go).
            ev = {"event": what, "pod": index, "at_s": round(t_e - self.t0, 1), "stuck": str(e), "start": t_e,
                  "furthest_step": max((s for _, s, _ in self.lines.steps(before=t_e)), default=0), "redone": 0,
                  "survivors_restarted": True}
            self.events.append(ev)
            return ev
        start = max(t_e, t_f)
        after = self.lines.steps(after=ready)
        redone = len({s for _, s, _ in after if s <= furthest})
        last_loss = next((l for t, s, l in reversed(done) if s == furthest), None)
        first_loss = after[0][2] if after else None

        def part(pattern, t0=t_e):
            hit = self.lines.after(t0, pattern)
            return None if hit is None else round(max(0.0, hit[0] - start), 3)

        if what == "term":
            # The pod's launcher ends on its own after a SIGTERM; its exit is not waited on above.
            pod.proc.wait(timeout=60)
        ev = {"event": what, "pod": index, "at_s": round(t_e - self.t0, 1), "furthest_step": furthest,
              "stall_s": round(beyond[0] - start, 3), "redone": redone,
              "detected_s": part(DETECTED), "reformed_s": part(FORMED), "ready_s": round(max(0.0, ready - start), 3),
              "restored_s": part(RESTORED, ready), "survivors_restarted": self.restarted(survivors, t_e, before),
              "loss_before": last_loss, "loss_after": first_loss}
        self.events.append(ev)
        return ev

    def go(self, schedule):
        try:
            for i in range(3):
                self.start(i)
            # A group of 2 can form first (a pod slower to start): the clock starts at the
            # first step of the group of 3.
            three = self.wait("the first group of 3", lambda: self.lines.after(-1.0, WORLD_OF_3), self.a.timeout * 2)
            self.wait("its first step", lambda: self.lines.steps(after=three[0]), self.a.timeout)
            self.t0 = self.lines.steps(after=three[0])[0][0]
            for at, what, index in schedule:
                pause = self.t0 + at - time.monotonic()
                if pause > 0:
                    self.wait("the next event", lambda: time.monotonic() >= self.t0 + at, pause + 5)
                ev = self.event(what, index)
                if "stuck" in ev:
                    print(f"  {self.kind:20} {what:4} pod{index} at {ev['at_s']:6.1f} s: the change did not go "
                          f"through: {ev['stuck']}{'; logs in ' + self.dir if self.a.keep else ''}", flush=True)
                    break
                print(f"  {self.kind:20} {what:4} pod{index} at {ev['at_s']:6.1f} s: stall {ev['stall_s']:.2f} s, "
                      f"{ev['redone']} redone, restarted={ev['survivors_restarted']}", flush=True)
            end = self.t0 + self.a.minutes * 60
            stuck = next((e for e in self.events if "stuck" in e), None)
            if stuck is None:
                self.wait("the end", lambda: time.monotonic() >= end, max(0.0, end - time.monotonic()) + 5)
            wall = max(end, time.monotonic()) - self.t0
            if stuck is not None:
                # What is lost is the time with no step: from the event, or from the last
                # step after it when the group trained on without the change going through
                # (a returning node that is never admitted), to the end.
                start = stuck.pop("start")
                since = max([start] + [t for t, _, _ in self.lines.steps(after=start)])
                stuck["stall_s"] = round(max(0.0, self.t0 + wall - since), 3)
            steps = self.lines.steps()
            healthy = [b[0] - a_[0] for a_, b in zip(steps, steps[1:]) if b[1] == a_[1] + 1]
            stalls = sum(e["stall_s"] for e in self.events)
            return {"kind": self.kind, "wall_s": round(wall, 1), "events": self.events,
                    "stalls_s": round(stalls, 3), "goodput": round(1 - stalls / wall, 4),
                    "steps": max(s for _, s, _ in steps), "step_s": round(statistics.median(healthy), 4)}
        except Stuck as e:
            print(f"  {self.kind}: stopped: {e}; logs in {self.dir}", flush=True)
            return {"kind": self.kind, "error": str(e), "events": self.events}
        finally:
            for p in [*self.pods.values(), *self.gone]:
                p.kill()
            if self.etcd:
                self.etcd.stop()
            if not self.a.keep:
                shutil.rmtree(self.dir, ignore_errors=True)


def schedule(a):
    """[(seconds from the first step, what, pod)]: kill x, x back, term y, y back, ... with
    x and y drawn from pods 1 and 2 by the seed, one event every --interval (±20%)."""
    rng = random.Random(a.seed)
    out, at = [], 0.0
    while True:
        x = rng.choice([1, 2])
        for what, pod in [("kill", x), ("back", x), ("term", 3 - x), ("back", 3 - x)]:
            at += a.interval * rng.uniform(0.8, 1.2)
            if at > a.minutes * 60 - a.interval / 2:
                return out
            out.append((round(at, 1), what, pod))


def mean(xs):
    return statistics.mean(xs) if xs else None


def modelled(result):
    """Goodput with a failure (a loss and its return) every interval, from the measured stalls."""
    if "error" in result or any("stuck" in e for e in result["events"]):
        return {}
    losses = [e["stall_s"] for e in result["events"] if e["event"] in ("kill", "term")]
    backs = [e["stall_s"] for e in result["events"] if e["event"] == "back"]
    if not losses or not backs:
        return {}
    pair = mean(losses) + mean(backs)
    return {str(i): round(max(0.0, 1 - pair / i), 4) for i in MODEL_INTERVALS}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", default=os.path.join(ROOT, "target/release/fsdp-agent"))
    ap.add_argument("--trainer", default=os.path.join(ROOT, "target/release/fsdp-trainer"))
    ap.add_argument("--minutes", type=float, default=3)
    ap.add_argument("--interval", type=float, default=20, help="seconds between events")
    ap.add_argument("--checkpoint-freq", dest="checkpoint_freq", type=int, default=25)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--timeout", type=float, default=120, help="seconds an event may take to recover")
    ap.add_argument("--json")
    ap.add_argument("--svg", help="write the modelled share of time lost against the failure interval here")
    ap.add_argument("--keep", action="store_true", help="keep the pods' logs")
    ap.add_argument("--tiny", action="store_true", help="one loss and one return, for the smoke test")
    a = ap.parse_args()
    if a.tiny:
        a.minutes, a.interval = 0.5, 10
    kinds = a.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        sys.exit(f"goodput: no launcher {', '.join(unknown)}; the launchers: {', '.join(KINDS)}")
    plan = schedule(a)
    workdir = tempfile.mkdtemp(prefix="bench-goodput-")
    print(f"machine: {os.cpu_count()} cpus; {a.minutes} min per launcher; {len(plan)} events "
          f"(seed {a.seed}, every {a.interval} s ±20%); a checkpoint every {a.checkpoint_freq} steps", flush=True)
    results = []
    for kind in kinds:
        r = Run(kind, a, workdir).go(plan)
        r["modelled"] = modelled(r)
        results.append(r)
    print()
    print("| launcher | event | pod | stall s | steps redone | detected | re-formed | worker ready | restored "
          "| survivors restarted | loss before → after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    cell = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    for r in results:
        for e in r["events"]:
            if "stuck" in e:
                print(f"| {r['kind']} | {e['event']} | {e['pod']} | {e.get('stall_s', 0):.2f} (to the end: "
                      f"{e['stuck']}) | | | | | | | |")
                continue
            print(f"| {r['kind']} | {e['event']} | {e['pod']} | {e['stall_s']:.2f} | {e['redone']} | "
                  f"{cell(e['detected_s'])} | {cell(e['reformed_s'])} | {cell(e['ready_s'])} | "
                  f"{cell(e['restored_s'])} | {'yes' if e['survivors_restarted'] else 'no'} | "
                  f"{cell(e['loss_before'])} → {cell(e['loss_after'])} |")
    print()
    print("| launcher | wall s | step s (healthy) | events | Σ stalls s | goodput | mean stall: loss / return s "
          "| steps redone | modelled goodput, a failure every " + " / ".join(f"{i} s" for i in MODEL_INTERVALS) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['kind']} | did not finish: {r['error']} |||||||")
            continue
        losses = [e["stall_s"] for e in r["events"] if e["event"] != "back"]
        backs = [e["stall_s"] for e in r["events"] if e["event"] == "back"]
        print(f"| {r['kind']} | {r['wall_s']} | {r['step_s']:.3f} | {len(r['events'])} | {r['stalls_s']:.2f} | "
              f"**{r['goodput']:.3f}** | {cell(mean(losses))} / {cell(mean(backs))} | "
              f"{sum(e['redone'] for e in r['events'])} | "
              + (" / ".join(f"{v:.3f}" for v in r["modelled"].values()) or "the job did not survive the schedule")
              + " |")
    print("(modelled: 1 - (mean stall of a loss + of a return) / interval; arithmetic on the stalls above)")
    if a.svg:
        series = [(r["kind"], [(int(i), max(1e-4, 1 - g)) for i, g in r["modelled"].items()])
                  for r in results if r.get("modelled")]
        title = "Share of wall time lost, a node lost and back every interval (modelled)"
        with open(a.svg, "w") as f:
            if series:
                f.write(svg.lines_loglog(title, "seconds between failures", "1 - goodput", series))
            else:
                f.write('<svg xmlns="http://www.w3.org/2000/svg" width="640" height="60" font-family="sans-serif">'
                        f'<text x="10" y="30">{title}: no launcher got through the schedule</text></svg>\n')
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"minutes": a.minutes, "interval_s": a.interval, "seed": a.seed,
                       "checkpoint_freq": a.checkpoint_freq, "schedule": plan, "results": results}, f, indent=1)
    if not a.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    # With --json the errors are in the results (bench/suite.py reports them); without it
    # the exit status says so.
    if any("error" in r for r in results) and not a.json:
        sys.exit(1)


if __name__ == "__main__":
    main()
