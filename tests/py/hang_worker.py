"""A worker for the hang tests: gloo all-reduce steps of 0.2 s, reporting each step with
examples/progress.py and checkpointing the step count (rank 0). On the first attempt,
rank STALL_RANK stalls forever at step STALL_AT, after its all-reduce and before it reports
the step (as a rank stuck in I/O would): the others block in the next all-reduce.

usage: hang_worker.py CKPT_DIR TOTAL_STEPS STALL_AT STALL_RANK [CHECKPOINT_EVERY]
A checkpoint every CHECKPOINT_EVERY steps takes 3 s (15 steps' time, longer than the
automatic allowance of 10 steps), inside a reported phase. FINAL_SAVE=RANK:SECONDS makes
that rank spend SECONDS after its last step, without reporting a phase, before it finishes
(a final save written as most scripts write it).
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from progress import finish, phase, step  # noqa: E402
from lines import say  # noqa: E402


def stall_forever():
    while True:
        time.sleep(3600)


def main():
    ckpt_dir, total, stall_at, stall_rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    every = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    path = os.path.join(ckpt_dir, "step")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    done = int(open(path).read()) if os.path.exists(path) else 0
    say(f"start rank={rank} step={done} restart={restart} t={time.time():.3f}")
    while done < total:
        t = torch.ones(1)
        dist.all_reduce(t)
        done += 1
        if restart == "0" and rank == stall_rank and done == stall_at:
            say(f"stall rank={rank} step={done} t={time.time():.3f}")
            stall_forever()
        step(done)
        if rank == 0:
            with open(path + ".tmp", "w") as f:
                f.write(str(done))
            os.replace(path + ".tmp", path)
        if every and done % every == 0:
            with phase("checkpoint"):
                time.sleep(3.0)
        time.sleep(0.2)
    final = os.environ.get("FINAL_SAVE", "")
    if final and int(final.split(":")[0]) == rank:
        time.sleep(float(final.split(":")[1]))
    # The group's teardown is not a step: under load it can take longer than the short
    # allowance these tests use.
    finish()
    say(f"done rank={rank} step={done}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
