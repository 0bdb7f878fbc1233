"""The fsdp-trainer model and loop written the usual way in Python/PyTorch, as the
baseline for samples/s (docs/benchmarks.md).

Same architecture, parameter order and initialisation, same synthetic samples (the same
splitmix64 hash), same per-rank batch, gradients averaged with DDP over gloo, AdamW.
Run it under fsdp-agent or torchrun; flags match fsdp-trainer's.
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

M64 = (1 << 64) - 1


def mix(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class Synthetic:
    def __init__(self, vocab):
        self.vocab = vocab
        succ = list(range(vocab))
        for i in range(vocab - 1, 0, -1):
            j = mix(0xC0FFEE ^ i) % (i + 1)
            succ[i], succ[j] = succ[j], succ[i]
        self.succ = succ

    def sample(self, index, length):
        state = mix(index)
        cur = state % self.vocab
        out = [cur]
        while len(out) < length:
            state = mix(state)
            cur = ((state >> 8) % self.vocab) if state % 10 == 0 else self.succ[cur]
            out.append(cur)
        return out

    def batch(self, first, batch, context):
        rows = [self.sample(first + i, context + 1) for i in range(batch)]
        t = torch.tensor(rows, dtype=torch.int64)
        return t[:, :-1], t[:, 1:]


class Decoder(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        h, nh, nkv = a.hidden_width, a.num_heads, a.num_key_value_heads
        hd = h // nh
        self.a, self.hd = a, hd
        params = [("embed", (a.vocab_size, h))]
        for l in range(a.num_layers):
            params += [
                (f"l{l}_attn_norm", (h,)), (f"l{l}_wq", (h, h)), (f"l{l}_wk", (nkv * hd, h)),
                (f"l{l}_wv", (nkv * hd, h)), (f"l{l}_wo", (h, h)), (f"l{l}_mlp_norm", (h,)),
                (f"l{l}_w_gate", (a.intermediate_size, h)), (f"l{l}_w_up", (a.intermediate_size, h)),
                (f"l{l}_w_down", (h, a.intermediate_size)),
            ]
        params += [("final_norm", (h,)), ("lm_head", (a.vocab_size, h))]
        self.names = [n for n, _ in params]
        self.p = torch.nn.ParameterList(
            torch.nn.Parameter(torch.ones(s) if n.endswith("norm") else torch.randn(s) * 0.02)
            for n, s in params
        )
        inv = torch.exp(torch.arange(0, hd, 2, dtype=torch.float32) / hd * -math.log(a.rotary_emb_base))
        freqs = torch.outer(torch.arange(a.max_context_width, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], -1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, tokens):
        a, p = self.a, self.p
        b, t = tokens.shape
        nh, nkv, hd = a.num_heads, a.num_key_value_heads, self.hd
        cos, sin = self.cos[:t], self.sin[:t]

        def rot(x):
            x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
            return x * cos + torch.cat([-x2, x1], -1) * sin

        def norm(x, w):
            return F.rms_norm(x, (a.hidden_width,), w, 1e-5)

        x = F.embedding(tokens, p[0])
        for l in range(a.num_layers):
            w = p[1 + l * 9 : 1 + (l + 1) * 9]
            h = norm(x, w[0])
            q = rot(F.linear(h, w[1]).view(b, t, nh, hd).transpose(1, 2))
            k = rot(F.linear(h, w[2]).view(b, t, nkv, hd).transpose(1, 2))
            v = F.linear(h, w[3]).view(b, t, nkv, hd).transpose(1, 2)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
            x = x + F.linear(att.transpose(1, 2).reshape(b, t, a.hidden_width), w[4])
            h = norm(x, w[5])
            x = x + F.linear(F.silu(F.linear(h, w[6])) * F.linear(h, w[7]), w[8])
        return F.linear(norm(x, p[-2]), p[-1])


def main():
    ap = argparse.ArgumentParser()
    for name, default in [
        ("hidden_width", 64), ("num_layers", 2), ("num_heads", 4), ("num_key_value_heads", 2),
        ("intermediate_size", 172), ("max_context_width", 64), ("vocab_size", 256),
        ("train_batch_size", 8), ("max_steps", 100), ("logging_freq", 1), ("seed", 42),
    ]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight_decay", type=float, default=0.01)
    ap.add_argument("--grad_clip", type=float, default=1.0)
    ap.add_argument("--rotary_emb_base", type=float, default=10000.0)
    ap.add_argument("--warmup", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (each rank on its LOCAL_RANK's GPU)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    model = Decoder(a).to(dev)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)
    warm = math.ceil(a.warmup * a.max_steps) if a.warmup < 1 else int(a.warmup)
    min_lr = a.lr / 10

    def lr_at(step):
        if step < warm:
            return a.lr * (step + 1) / warm
        prog = min(1.0, (step - warm) / max(1, a.max_steps - warm))
        return min_lr + 0.5 * (a.lr - min_lr) * (1 + math.cos(math.pi * prog))

    data = Synthetic(a.vocab_size)
    seen, t0, window = 0, time.perf_counter(), 0
    for step in range(a.max_steps):
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = data.batch(seen + rank * a.train_batch_size, a.train_batch_size, a.max_context_width)
        x, y = x.to(dev), y.to(dev)
        loss = F.cross_entropy(model(x).reshape(-1, a.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        seen += a.train_batch_size * world
        window += a.train_batch_size * world
        if (step + 1) % a.logging_freq == 0 or step + 1 == a.max_steps:
            l = loss.detach().clone()
            if world > 1:
                dist.all_reduce(l)
            if rank == 0:
                dt = max(time.perf_counter() - t0, 1e-9)
                print(f"Batch {step} Loss: {l.item() / world:.5f}, Speed: {window / dt:.2f} samples/sec, lr: {lr:.6f}", flush=True)
            t0, window = time.perf_counter(), 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"Rank {rank} peak RSS: {peak:.1f} MiB", flush=True)
    if world > 1:
        # Every rank reaches the end, then leaves without running gloo's destructors: a
        # rank tearing its group down while a peer's gloo threads still touched it aborted
        # that peer ("terminate called without an active exception", SIGABRT), even after
        # a barrier, in loaded test runs. Nothing is left to release at process exit.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
