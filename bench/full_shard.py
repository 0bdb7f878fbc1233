"""Full sharding benchmark (docs/benchmarks.md §11): fsdp-trainer's `full` against
`no_shard` and `shard_grad_op`, and against PyTorch's own FSDP2 on CPU/Gloo.

* memory: peak RSS per rank (VmHWM) at world 1, 2, 4 for the three strategies on one
  model, beside what the arithmetic predicts for `full`;
* budget: the largest model (decoder layers of a fixed width) that trains under a fixed
  limit of private memory per rank (RLIMIT_DATA, `ulimit -d`: heap and anonymous
  mappings, not the shared libraries), at world 2 and 4;
* speed: samples/s at world 2 (`--speed-world`) of `full` (with and without prefetch) and `no_shard`, and of
  the same model in Python under FSDP2 (`bench/fsdp2_baseline.py`) and DDP
  (`trainer/baseline/train_baseline.py`).

usage: python bench/full_shard.py [--only memory,budget,speed] [--runs 2] [--budget-mib 1024]
                                  [--speed-world 2]
                                  [--agent target/release/fsdp-agent]
                                  [--trainer target/release/fsdp-trainer] [--tiny]
       python bench/full_shard.py --render result.json
--tiny: a small model at world 1 and 2, the budget of `full` alone (give a small
--budget-mib), no Python kinds in the speed runs: the smoke test's sizes.
Prints one JSON object on stdout, progress and the markdown tables on stderr.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DDP = os.path.join(ROOT, "trainer/baseline/train_baseline.py")
FSDP2 = os.path.join(ROOT, "bench/fsdp2_baseline.py")
STRATEGIES = ["no_shard", "shard_grad_op", "full"]

# As bench/trainer.py's: ~93M parameters, 16 bytes each of state unsharded.
MEMORY_MODEL = ["--hidden_width", "1024", "--num_layers", "8", "--num_heads", "16", "--num_key_value_heads", "8",
                "--intermediate_size", "2752", "--max_context_width", "64", "--train_batch_size", "1"]
# The budget search varies --num_layers of this (11.5M parameters a layer).
BUDGET_MODEL = ["--hidden_width", "1024", "--num_heads", "16", "--num_key_value_heads", "8",
                "--intermediate_size", "2752", "--max_context_width", "32", "--train_batch_size", "1"]
# BUDGET_MODEL's parameters: embedding, final norm and head; one layer (2 norms, q and o
# 1024², k and v 512 × 1024, three MLP matrices 2752 × 1024).
BUDGET_BASE = 2 * 256 * 1024 + 1024
BUDGET_LAYER = 2 * 1024 + 2 * 1024 * 1024 + 2 * 512 * 1024 + 3 * 2752 * 1024
SPEED_MODEL = ["--hidden_width", "256", "--num_layers", "4", "--num_heads", "8", "--num_key_value_heads", "4",
               "--intermediate_size", "688", "--max_context_width", "128", "--train_batch_size", "8"]
TINY = ["--hidden_width", "64", "--num_layers", "2", "--intermediate_size", "172", "--train_batch_size", "2"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def launch(a, program, args, nproc, check=True, timeout=600):
    cmd = [a.agent, "--standalone", "--nproc-per-node", str(nproc), "--status-addr", "off", "--max-restarts", "0",
           "--no-python"] + program + args
    # A rank that runs out of memory panics; a backtrace taken then can itself hang on a
    # failed allocation, so none is taken.
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_BACKTRACE="0")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        if check:
            raise
        return None
    if out.returncode != 0 and check:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out.stdout


def peaks(text):
    return [float(m) for m in re.findall(r"Rank \d+ peak RSS: ([0-9.]+) MiB", text)]


def model_line(text):
    line = next(l for l in text.splitlines() if "Model: " in l)
    params = int(re.search(r"Model: (\d+) parameters", line).group(1))
    unit = re.search(r"largest unit ([0-9.]+) MiB", line)
    return params, float(unit.group(1)) if unit else None


def bench_memory(a):
    model = TINY if a.tiny else MEMORY_MODEL
    rows = []
    for world in [1, 2] if a.tiny else [1, 2, 4]:
        for strategy in STRATEGIES:
            text = launch(a, [a.trainer], model + ["--max_steps", "2", "--threads", "1",
                                                  "--sharding_strategy", strategy], world)
            params, unit = model_line(text)
            p = peaks(text)
            rows.append({"world": world, "strategy": strategy, "peak_mib": p, "params": params, "unit_mib": unit})
            log(f"memory: world {world} {strategy}: peak RSS per rank {p} MiB ({params} parameters)")
    return rows


def bench_budget(a):
    """Largest --num_layers that trains 2 steps with RLIMIT_DATA = budget per rank."""
    kib = a.budget_mib * 1024
    wrapped = ["/bin/sh", "-c", f'ulimit -d {kib}; exec "$0" "$@"', a.trainer]
    rows = []
    for world in [1, 2, 4] if not a.tiny else [2]:
        for strategy in STRATEGIES if not a.tiny else ["full"]:
            if world == 1 and strategy != "no_shard":
                continue
            # Bytes of state a layer adds per rank: params, grads, two moments (16 B a
            # parameter) unsharded; grads' shard and moments sharded under shard_grad_op;
            # everything sharded under full. It only picks the first probe.
            per_param = {"no_shard": 16, "shard_grad_op": 8 + 12 / world, "full": 16 / world}[strategy]
            probe = max(1, int((a.budget_mib - 150) * 2**20 / (11.5e6 * per_param)))
            ok, bad, tried = 0, None, {}
            while probe not in tried and probe >= 1:
                args = BUDGET_MODEL + ["--num_layers", str(probe), "--max_steps", "2", "--threads", "1",
                                       "--logging_freq", "1", "--collective_timeout", "20", "--sharding_strategy", strategy]
                text = launch(a, wrapped, args, world, check=False, timeout=300)
                good = text is not None and "Training finished" in text
                tried[probe] = peaks(text) if good else None
                log(f"budget {a.budget_mib} MiB: world {world} {strategy} {probe} layers: "
                    f"{'trains, peak RSS ' + str(peaks(text)) if good else 'fails'}")
                if good:
                    ok = max(ok, probe)
                else:
                    bad = probe if bad is None else min(bad, probe)
                if a.tiny and len(tried) >= 2:
                    break
                # Grow by a quarter until something fails, then bisect.
                probe = ok + max(1, ok // 4) if bad is None else (ok + bad) // 2
            params = BUDGET_BASE + ok * BUDGET_LAYER
            rows.append({"world": world, "strategy": strategy, "layers": ok, "params": params,
                         "peak_mib": tried.get(ok), "tried": {str(k): v for k, v in tried.items()}})
            log(f"budget: world {world} {strategy}: at most {ok} layers ({params} parameters)")
    return rows


def speeds(text, skip):
    s = [float(m) for m in re.findall(r"Speed: ([0-9.]+) samples/sec", text)]
    return s[skip:]


def bench_speed(a):
    model = [] if a.tiny else SPEED_MODEL
    steps = "8" if a.tiny else "24"
    common = model + ["--max_steps", steps, "--logging_freq", "2" if a.tiny else "4", "--threads", "1"]
    kinds = {
        "no_shard": ([a.trainer], ["--sharding_strategy", "no_shard"]),
        "full": ([a.trainer], ["--sharding_strategy", "full"]),
        "full, no prefetch": ([a.trainer], ["--sharding_strategy", "full", "--prefetch", "false"]),
        "python FSDP2": ([a.python, FSDP2], []),
        "python DDP": ([a.python, DDP], []),
    }
    if a.tiny:
        # The smoke test's time: the Python kinds import torch in every rank.
        del kinds["python FSDP2"], kinds["python DDP"]
    out = {}
    for _ in range(a.runs):
        # Interleaved, so a slow spell on the shared machine spreads over every kind.
        for name, (program, extra) in kinds.items():
            # Python's Gloo sometimes aborts in destroy_process_group after the last step;
            # the speeds it logged stand.
            text = launch(a, program, common + extra, a.speed_world, check=False)
            if not speeds(text, skip=2):
                raise RuntimeError(f"{name}: no speeds logged:\n{text[-2000:]}")
            out.setdefault(name, []).append(statistics.median(speeds(text, skip=2)))
    for name, s in out.items():
        log(f"speed, world {a.speed_world}: {name}: samples/s per run {['%.1f' % x for x in s]}")
    return out


def render(r):
    """The markdown tables of docs/benchmarks.md §11 from a result object."""
    md = []
    if "memory" in r:
        rows = r["memory"]
        n, unit = rows[0]["params"], max(x["unit_mib"] or 0 for x in rows)
        md += [f"Peak RSS per rank (VmHWM, MiB; the highest rank), {n} parameters, 2 steps:", "",
               "| world | no_shard | shard_grad_op | full | full saves vs no_shard | arithmetic: 16·N·(1 − 1/world) − 3 units |",
               "|---|---|---|---|---|---|"]
        for w in sorted({x["world"] for x in rows}):
            p = {x["strategy"]: max(x["peak_mib"]) for x in rows if x["world"] == w}
            pred = 16 * n * (1 - 1 / w) / 2**20 - 3 * unit
            md.append(f"| {w} | {p['no_shard']:.0f} | {p['shard_grad_op']:.0f} | {p['full']:.0f} | "
                      f"{p['no_shard'] - p['full']:.0f} | {pred:.0f} |")
        md.append("")
    if "budget" in r:
        md += [f"Largest model that trains under `ulimit -d` {r['budget_mib']} MiB per rank (layers of 11.6M "
               "parameters; the peak RSS, which also counts the shared libraries, of that run):", "",
               "| world | strategy | layers | parameters | peak RSS MiB per rank |", "|---|---|---|---|---|"]
        for x in r["budget"]:
            peak = ", ".join(f"{v:.0f}" for v in x["peak_mib"] or [])
            md.append(f"| {x['world']} | {x['strategy']} | {x['layers']} | {x['params'] / 1e6:.0f}M | {peak} |")
        md.append("")
    if "speed" in r:
        md += [f"samples/s at world {r.get('speed_world', 2)} (median of the logged speeds after the first two, "
               "per run):", "",
               "| | runs | median | vs no_shard |", "|---|---|---|---|"]
        base = statistics.median(r["speed"]["no_shard"])
        for name, s in r["speed"].items():
            m = statistics.median(s)
            md.append(f"| {name} | {', '.join('%.1f' % x for x in s)} | {m:.1f} | {m / base:.2f}x |")
        md.append("")
    return "\n".join(md)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="memory,budget,speed")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--budget-mib", type=int, default=1024)
    ap.add_argument("--speed-world", type=int, default=2, help="ranks of the speed runs")
    ap.add_argument("--agent", default=os.path.join(ROOT, "target/release/fsdp-agent"))
    ap.add_argument("--trainer", default=os.path.join(ROOT, "target/release/fsdp-trainer"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--tiny", action="store_true", help="smoke-test sizes")
    ap.add_argument("--render", metavar="JSON", help="print the markdown tables of a saved result and exit")
    a = ap.parse_args()
    if a.render:
        with open(a.render) as f:
            print(render(json.load(f)))
        return
    result = {"budget_mib": a.budget_mib, "speed_world": a.speed_world}
    for part, fn in [("memory", bench_memory), ("budget", bench_budget), ("speed", bench_speed)]:
        if part in a.only.split(","):
            result[part] = fn(a)
    log(render(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
