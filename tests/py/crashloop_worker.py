"""A worker that crashes at the same step every attempt: steps of 0.05 s reported with
examples/progress.py, rank 0 checkpoints every 5 steps, and rank 0 exits 1 right after
step CRASH_AT, before checkpointing it. Each restart resumes from the last checkpoint
and dies at the same step again: a crash loop that makes no progress.

usage: crashloop_worker.py CKPT_DIR CRASH_AT
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from progress import step  # noqa: E402
from lines import say  # noqa: E402


def main():
    ckpt_dir, crash_at = sys.argv[1], int(sys.argv[2])
    path = os.path.join(ckpt_dir, "step")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    done = int(open(path).read()) if os.path.exists(path) else 0
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    say(f"start rank={rank} step={done} restart={restart}")
    while True:
        t = torch.ones(1)
        dist.all_reduce(t)
        done += 1
        step(done)
        if done == crash_at and rank == 0:
            time.sleep(0.2)  # the report reaches the agent before the crash
            raise SystemExit(1)
        if rank == 0 and done % 5 == 0:
            with open(path + ".tmp", "w") as f:
                f.write(str(done))
            os.replace(path + ".tmp", path)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
