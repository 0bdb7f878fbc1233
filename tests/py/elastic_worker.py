"""A training stand-in for the fault tests: gloo all-reduce in a loop, rank 0 checkpoints
the step counter (atomically) to a shared directory, and a restart resumes from it.

usage: elastic_worker.py CKPT_DIR TOTAL_STEPS [--fail-on HOST | --fail-first-on-all]
--fail-on HOST: the worker on HOST exits 3 at every start.
--fail-first-on-all: every worker exits 3 in the first attempt (restart 0).
SIGUSR1 (a pre-emption warning) ends the worker at once, exit 0, after saying so: the
checkpoint is already the last step's.
"""
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
from lines import say


def main():
    ckpt_dir, total = sys.argv[1], int(sys.argv[2])
    fail_on = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--fail-on" else None
    fail_first = len(sys.argv) > 3 and sys.argv[3] == "--fail-first-on-all"
    path = os.path.join(ckpt_dir, "step")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    step = int(open(path).read()) if os.path.exists(path) else 0
    host = socket.gethostname()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    say(f"start host={host} rank={rank} world={world} step={step} restart={restart} pid={os.getpid()} group_rank={os.environ['GROUP_RANK']}")
    if fail_on == host or (fail_first and restart == "0"):
        raise SystemExit(3)

    def preempted(signum, frame):
        say(f"preempted host={host} rank={rank} step={step}")
        sys.exit(0)

    signal.signal(signal.SIGUSR1, preempted)
    first = True
    while step < total:
        t = torch.ones(1)
        dist.all_reduce(t)
        if t.item() != world:
            raise SystemExit(f"all_reduce gave {t.item()} in a world of {world}")
        if first:
            # For the benchmarks: when this group's first collective completed (wall clock).
            say(f"allreduced host={host} rank={rank} world={world} t={time.time():.6f}")
            first = False
        step += 1
        if rank == 0:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                f.write(str(step))
            os.replace(tmp, path)
        time.sleep(0.05)
    say(f"done host={host} rank={rank} world={world} step={step}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
