"""torchrun's file-timer watchdog, used as torchrun users do: PyTorch's own
FileTimerClient on TORCHELASTIC_TIMER_FILE and `timer.expires`. On the first attempt
rank 1 overstays its 1 s scope."""
import os
import time

import torch.distributed as dist
from torch.distributed.elastic import timer


def main():
    dist.init_process_group("gloo")
    rank, restart = dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"]
    timer.configure(timer.FileTimerClient(file_path=os.environ["TORCHELASTIC_TIMER_FILE"]))
    print(f"start rank={rank} restart={restart}", flush=True)
    with timer.expires(after=1, scope="step"):
        time.sleep(60 if restart == "0" and rank == 1 else 0.1)
    dist.barrier()
    print(f"done rank={rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
