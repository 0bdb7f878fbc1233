"""An unmodified PyTorch distributed script: gloo all-reduce of each rank's number.

Run it under the agent:  fsdp-agent --standalone --nproc-per-node 2 examples/allreduce.py
"""
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")  # env:// from MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    start = time.perf_counter()
    dist.all_reduce(t)
    ms = (time.perf_counter() - start) * 1e3
    expected = world * (world + 1) / 2
    # One write per line: the workers share the launcher's stdout (as under torchrun), and
    # print() writes the text and its newline separately, so two ranks' lines can mix.
    sys.stdout.write(
        f"rank {rank}/{world} local_rank {os.environ['LOCAL_RANK']}: "
        f"all_reduce sum = {t.item():g} (expected {expected:g}) in {ms:.1f} ms\n"
    )
    sys.stdout.flush()
    dist.destroy_process_group()
    if t.item() != expected:
        raise SystemExit(f"wrong sum {t.item()} != {expected}")


if __name__ == "__main__":
    main()
