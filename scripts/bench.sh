#!/usr/bin/env bash
# Every benchmark in one run, on this machine, against torchrun wherever it has a
# counterpart; regenerates docs/benchmarks.md, whole, and docs/bench/*.svg and results.json.
# Not part of the tests (a smoke test runs the suite at tiny sizes). Extra arguments go to
# bench/suite.py (e.g. --tiny --out /tmp/r, or --only prewarm,sim for some steps as JSON).
#
# About 85 minutes on 2 cores, after the build. Each step, estimated from the scripts' own
# run lengths (bench/suite.py's STEPS; the report's Reproduce section gives what each took):
#   launch         1    fsdp-agent and torchrun --standalone /bin/true, N = 1, 2, 8
#   idle           1    8 idle workers for 10 s under each launcher
#   elastic       12    bench/elastic.py: 5 scenarios × 4 launchers (§3–5 and §10)
#   rendezvous     3    rdzv-bench at 8 to 1,000 simulated nodes, torch's etcd-v2 to 64
#   agents_scale   1    bench/agents_scale.py: 256 real agents, SIGTERM and SIGKILL
#   trainer        3    bench/trainer.py
#   hangs          2    bench/hangs.py (torchrun given a minute to recover from a stall)
#   demo           1.5  bench/demo.py: the demo of scripts/demo.sh, 800 steps
#   full_shard    11    bench/full_shard.py --runs 2 --budget-mib 1024
#   prewarm        7    bench/prewarm.py --runs 2: 3 scenarios × 3 launchers
#   livelock       1.5  bench/livelock.py --runs 3
#   sim            2.5  the simulator: 29,000 seeds, and each fix switched off
#   slurm          6.5  bench/slurm.py --runs 3 on a three-node Slurm of its own (root and
#                       Debian's Slurm packages, which scripts/setup.sh installs; without
#                       them the section says so)
#   mixed          0.5  bench/mixed.py: a job half under torchrun, 4 ways
#   checkpoint     2.5  bench/checkpoint.py --worlds 2,4
#   precision      3.5  bench/precision.py: fp32 against bf16
#   goodput       17    bench/goodput.py --minutes 4: 4 launchers through one schedule
#   stragglers     7    bench/stragglers.py: a node slowed by a cgroup, replace and warn
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build --release -p fsdp-agent -p fsdp-trainer -p fsdp-tests --bins
# The simulator (step sim), behind the rendezvous' `sim` feature: a build of its own, so
# that the agent built above stays without it.
cargo build --release -p fsdp-rendezvous --features sim --example sim
exec "$FSDP_VENV/bin/python" bench/suite.py "$@"
