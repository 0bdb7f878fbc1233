"""torch's dynamic rendezvous on its etcd-v2 backend (what `torchrun --rdzv-backend
etcd-v2` uses), driven like rdzv-bench drives ours: N simulated nodes in one process (one
thread each, as torchrun has one agent per node), all joining one run on one etcd; the
figure is the time from the first join to every node holding the sealed round.

usage: python bench/torch_rdzv.py --endpoint HOST:PORT --nodes N [--timeout S]
Prints `nodes=N seal_s=<seconds>` as its last line, or `nodes=N seal_s=timeout`.
Needs etcd started with --enable-v2 and python-etcd installed.
"""
import argparse
import logging
import sys
import threading
import time
import uuid

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    done, errors = [], []

    def node(i):
        try:
            params = RendezvousParameters(
                backend="etcd-v2", endpoint=a.endpoint, run_id=run_id, min_nodes=a.nodes, max_nodes=a.nodes,
                local_addr=f"127.0.{20 + i // 250}.{i % 250 + 1}", join_timeout=str(int(a.timeout)), last_call_timeout="1")
            backend, store = create_backend(params)
            handler = create_handler(store, backend, params)
            handler.next_rendezvous()
            done.append(time.monotonic())
        except Exception as e:  # reported, not fatal: the figure says how many finished
            errors.append(repr(e))

    t0 = time.monotonic()
    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(a.nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, t0 + a.timeout - time.monotonic()))
    if len(done) == a.nodes:
        print(f"nodes={a.nodes} seal_s={max(done) - t0:.3f}")
    else:
        print(f"nodes={a.nodes} sealed={len(done)} errors={len(errors)} {errors[:1]}", file=sys.stderr)
        print(f"nodes={a.nodes} seal_s=timeout")
    sys.stdout.flush()
    # Daemon threads may still poll etcd; leave without waiting for them.
    import os
    os._exit(0)


if __name__ == "__main__":
    main()
