"""torchrun's file-timer watchdog, used as torchrun users do: PyTorch's own
FileTimerClient on TORCHELASTIC_TIMER_FILE and `timer.expires`. On the first attempt
rank 1 overstays its 1 s scope."""
import os
import time

import torch.distributed as dist
from torch.distributed.elastic import timer
from lines import say


def main():
    dist.init_process_group("gloo")
    rank, restart = dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"]
    timer.configure(timer.FileTimerClient(file_path=os.environ["TORCHELASTIC_TIMER_FILE"]))
    say(f"start rank={rank} restart={restart}")
    with timer.expires(after=1, scope="step"):
        time.sleep(60 if restart == "0" and rank == 1 else 0.1)
    dist.barrier()
    say(f"done rank={rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
