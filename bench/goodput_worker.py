"""The goodput benchmark's PyTorch script: fsdp-trainer's model under FSDP2
(bench/fsdp2_baseline.py's `Units`, `fully_shard` per unit, Gloo on CPU), saving with
torch.distributed.checkpoint (DCP) every `--checkpoint_freq` steps and resuming from the
newest complete one, as a user's elastic FSDP2 script does under torchrun.

It prints the lines bench/goodput.py reads, in fsdp-trainer's words, on the group's rank
0: `Model: ...` once the process group is up and the model sharded, `Loaded checkpoint DIR
(step N, ...)` after a resume, `Batch N Loss: L` after every step, `Saved checkpoint DIR
(step N)` after a save. The state saved is what a resume needs: the model's and the
optimizer's shards, the step and the samples seen (the data position); DCP reshards it to
whatever world size the next group has.

usage (under torchrun or fsdp-agent): goodput_worker.py --checkpoint_dir DIR [--checkpoint_freq 25]
                                        [model flags as fsdp2_baseline.py]
"""

import argparse
import datetime
import math
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "trainer/baseline"))
import fsdp2_baseline  # noqa: E402
import train_baseline as tb  # noqa: E402

# A checkpoint is complete once DCP wrote its metadata, which it does last.
COMPLETE = ".metadata"


def newest(ckpt_dir):
    """(step, path) of the newest complete checkpoint, or None."""
    best = None
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
        path = os.path.join(ckpt_dir, name)
        if name.startswith("step_") and os.path.exists(os.path.join(path, COMPLETE)):
            step = int(name[len("step_"):])
            if best is None or step > best[0]:
                best = (step, path)
    return best


def main():
    ap = argparse.ArgumentParser()
    for name, default in [
        ("hidden_width", 128), ("num_layers", 4), ("num_heads", 8), ("num_key_value_heads", 4),
        ("intermediate_size", 344), ("max_context_width", 64), ("vocab_size", 256),
        ("train_batch_size", 8), ("max_steps", 1_000_000), ("seed", 42), ("threads", 1),
        ("checkpoint_freq", 25), ("keep", 2), ("pg_timeout", 30),
    ]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--checkpoint_dir", required=True)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight_decay", type=float, default=0.01)
    ap.add_argument("--grad_clip", type=float, default=1.0)
    ap.add_argument("--rotary_emb_base", type=float, default=10000.0)
    ap.add_argument("--warmup", type=float, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    # Gloo's default timeout is 30 minutes; torchrun's restarted workers sometimes wait on a
    # peer that never comes (bench/elastic.py's "never" rows): a bound, as a user would set,
    # ends that wait and torchrun tries again.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(a.seed)
    model = fsdp2_baseline.Units(a)
    for unit in [model.embed, *model.layers, model.out]:
        fully_shard(unit)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)
    params = sum(p.numel() for p in model.parameters())
    say = print if rank == 0 else (lambda *_, **__: None)
    say(f"Model: {params} parameters, {a.num_layers} layers, hidden {a.hidden_width}; world size {world}", flush=True)

    step, seen = 0, 0
    found = newest(a.checkpoint_dir)
    if found:
        # Every rank must load the same step: rank 0's choice is broadcast, as a save in
        # progress on another rank could make them see different directories.
        pick = [found[0]]
        dist.broadcast_object_list(pick, src=0)
        path = os.path.join(a.checkpoint_dir, f"step_{pick[0]}")
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "meta": {"step": 0, "seen": 0}}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step, seen = state["meta"]["step"], state["meta"]["seen"]
        say(f"Loaded checkpoint {path} (step {step}, sample {seen})", flush=True)

    warm = int(a.warmup)

    def lr_at(s):
        if s < warm:
            return a.lr * (s + 1) / warm
        return a.lr / 10 + 0.45 * a.lr * (1 + math.cos(math.pi * min(1.0, (s - warm) / 10_000)))

    data = tb.Synthetic(a.vocab_size)
    while step < a.max_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = data.batch(seen + rank * a.train_batch_size, a.train_batch_size, a.max_context_width)
        loss = F.cross_entropy(model(x).float().reshape(-1, a.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        l = loss.detach().clone()
        dist.all_reduce(l)
        say(f"Batch {step} Loss: {l.item() / world:.5f}", flush=True)
        step += 1
        seen += a.train_batch_size * world
        if step % a.checkpoint_freq == 0:
            path = os.path.join(a.checkpoint_dir, f"step_{step}")
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "meta": {"step": step, "seen": seen}}, checkpoint_id=path)
            say(f"Saved checkpoint {path} (step {step})", flush=True)
            if rank == 0:
                for old in sorted(int(n[5:]) for n in os.listdir(a.checkpoint_dir) if n.startswith("step_"))[:-a.keep]:
                    shutil.rmtree(os.path.join(a.checkpoint_dir, f"step_{old}"), ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
