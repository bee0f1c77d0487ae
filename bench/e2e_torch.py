"""The PyTorch peer of ``bench/e2e.py``: the same GPT trained with ``DistributedDataParallel``
on the gloo backend (CPU), one process per rank, launched with ``mpirun``.

Same architecture as ``core.models.gpt`` at tp=pp=1 (pre-norm, learned positions, fused QKV,
causal SDPA, GELU MLP, tied output layer), AdamW with the same hyper-parameters and global
batch. Prints one JSON line (rank 0) with the median step time and peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np


def _setup_threads() -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    from core.runtime.cpu_threads import configure_cpu_threads

    n = configure_cpu_threads()
    torch.set_num_threads(n)
    return n


def build_model(vocab: int, hidden: int, heads: int, layers: int, seq: int):
    """The GPT as a torch module."""
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, heads, 3, h // heads).permute(3, 0, 2, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.ln_f = nn.LayerNorm(hidden)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)

        def forward(self, tokens, labels):
            x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
            for layer in self.layers:
                x = layer(x)
            logits = self.ln_f(x) @ self.wte.weight.t()
            return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))

    return GPT()


def main() -> None:
    """Train ``--steps`` steps and report rank 0's JSON line."""
    p = argparse.ArgumentParser()
    for name, default in [("layers", 4), ("hidden", 256), ("heads", 4), ("seq", 256), ("global-batch", 32),
                          ("steps", 10), ("warmup", 3)]:
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    threads = _setup_threads()
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        build_model(256, args.hidden, args.heads, args.layers, args.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    local = args.global_batch // world
    rng = np.random.default_rng(rank)
    times = []
    for step in range(args.warmup + args.steps):
        toks = torch.from_numpy(rng.integers(0, 256, (local, args.seq + 1)).astype(np.int64))
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(toks[:, :-1], toks[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = torch.tensor([mem], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        step_time = statistics.median(times)
        print(json.dumps({"impl": "torch_ddp", "world": world, "layout": "dp", "step_time_s": step_time,
                          "tokens_per_sec": args.global_batch * args.seq / step_time,
                          "peak_memory_bytes": int(peak.item()), "threads": threads}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
