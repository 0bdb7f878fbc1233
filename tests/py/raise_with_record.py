"""Fails on local rank 1 with an exception recorded by torch's @record."""
import os

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    if os.environ["LOCAL_RANK"] == "1":
        raise ValueError("deliberate failure on local rank 1")


if __name__ == "__main__":
    main()
