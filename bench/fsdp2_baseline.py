"""The fsdp-trainer model under PyTorch's own FSDP2 (`torch.distributed.fsdp.fully_shard`)
on CPU/Gloo, with activation checkpointing per decoder layer: the Python counterpart of
`fsdp-trainer --sharding_strategy full` for bench/full_shard.py.

The parameters are trainer/baseline/train_baseline.py's (same initialisation, order,
samples, schedule, AdamW and clipping), regrouped into the trainer's units (embedding,
each layer, final norm with head), each wrapped by fully_shard, so the losses match
fsdp-trainer's step by step. Flags as train_baseline.py's; run under fsdp-agent or
torchrun.
"""

import argparse
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer/baseline"))
import train_baseline as tb  # noqa: E402


class Embed(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = w

    def forward(self, tokens):
        return F.embedding(tokens, self.weight)


class Layer(torch.nn.Module):
    def __init__(self, a, ws):
        super().__init__()
        self.a = a
        self.w = torch.nn.ParameterList(ws)

    def forward(self, x, cos, sin):
        a, w = self.a, self.w
        b, t, _ = x.shape
        nh, nkv = a.num_heads, a.num_key_value_heads
        hd = a.hidden_width // nh

        def rot(y):
            y1, y2 = y[..., : hd // 2], y[..., hd // 2 :]
            return y * cos + torch.cat([-y2, y1], -1) * sin

        def norm(y, g):
            return F.rms_norm(y, (a.hidden_width,), g, 1e-5)

        h = norm(x, w[0])
        q = rot(F.linear(h, w[1]).view(b, t, nh, hd).transpose(1, 2))
        k = rot(F.linear(h, w[2]).view(b, t, nkv, hd).transpose(1, 2))
        v = F.linear(h, w[3]).view(b, t, nkv, hd).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
        x = x + F.linear(att.transpose(1, 2).reshape(b, t, a.hidden_width), w[4])
        h = norm(x, w[5])
        return x + F.linear(F.silu(F.linear(h, w[6])) * F.linear(h, w[7]), w[8])


class Head(torch.nn.Module):
    def __init__(self, a, norm, head):
        super().__init__()
        self.a, self.norm, self.head = a, norm, head

    def forward(self, x):
        return F.linear(F.rms_norm(x, (self.a.hidden_width,), self.norm, 1e-5), self.head)


class Units(torch.nn.Module):
    """train_baseline.Decoder's parameters, regrouped into fully_shard units."""

    def __init__(self, a):
        super().__init__()
        flat = tb.Decoder(a)
        p = list(flat.p)
        self.embed = Embed(p[0])
        self.layers = torch.nn.ModuleList(Layer(a, p[1 + 9 * l : 1 + 9 * (l + 1)]) for l in range(a.num_layers))
        self.out = Head(a, p[-2], p[-1])
        self.register_buffer("cos", flat.cos, persistent=False)
        self.register_buffer("sin", flat.sin, persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False)
        return self.out(x)


def main():
    ap = argparse.ArgumentParser()
    for name, default in [
        ("hidden_width", 64), ("num_layers", 2), ("num_heads", 4), ("num_key_value_heads", 2),
        ("intermediate_size", 172), ("max_context_width", 64), ("vocab_size", 256),
        ("train_batch_size", 8), ("max_steps", 100), ("logging_freq", 1), ("seed", 42), ("threads", 0),
    ]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight_decay", type=float, default=0.01)
    ap.add_argument("--grad_clip", type=float, default=1.0)
    ap.add_argument("--rotary_emb_base", type=float, default=10000.0)
    ap.add_argument("--warmup", type=float, default=0.05)
    # As fsdp-trainer --bf16=1: bf16 gathers and compute, fp32 gradient reduction and master
    # weights, the loss's softmax in fp32.
    ap.add_argument("--bf16", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dist.init_process_group("gloo")
    torch.manual_seed(a.seed)
    model = Units(a)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if a.bf16 else MixedPrecisionPolicy()
    for unit in [model.embed, *model.layers, model.out]:
        fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)
    warm = math.ceil(a.warmup * a.max_steps) if a.warmup < 1 else int(a.warmup)
    min_lr = a.lr / 10

    def lr_at(step):
        if step < warm:
            return a.lr * (step + 1) / warm
        prog = min(1.0, (step - warm) / max(1, a.max_steps - warm))
        return min_lr + 0.5 * (a.lr - min_lr) * (1 + math.cos(math.pi * prog))

    data = tb.Synthetic(a.vocab_size)
    seen, t0, window = 0, time.perf_counter(), 0
    for step in range(a.max_steps):
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = data.batch(seen + rank * a.train_batch_size, a.train_batch_size, a.max_context_width)
        loss = F.cross_entropy(model(x).float().reshape(-1, a.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        seen += a.train_batch_size * world
        window += a.train_batch_size * world
        if (step + 1) % a.logging_freq == 0 or step + 1 == a.max_steps:
            l = loss.detach().clone()
            dist.all_reduce(l)
            if rank == 0:
                dt = max(time.perf_counter() - t0, 1e-9)
                print(f"Batch {step} Loss: {l.item() / world:.5f}, Speed: {window / dt:.2f} samples/sec, lr: {lr:.6f}", flush=True)
            t0, window = time.perf_counter(), 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"Rank {rank} peak RSS: {peak:.1f} MiB", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
