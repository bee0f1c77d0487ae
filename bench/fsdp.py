"""Megatron-FSDP ``optim`` against ``optim_grads``: the compiled step's memory and its time.

    python bench/fsdp.py                        # dp 8 on 8 simulated CPU devices, 4 microbatches
    python bench/fsdp.py --rounds 10 --out bench/results/fsdp.md

A small GPT (4 layers, hidden 128, sequence 64, one sample per microbatch and rank) trained by
the fused step at dp 8 with 4 microbatches, ``use_megatron_fsdp`` with the strategy ``optim``
(ZeRO-1: the accumulated grads are reduce-scattered once per step) or ``optim_grads`` (ZeRO-2:
each microbatch's grads are reduce-scattered right after its backward, only shard-sized
accumulators cross microbatches), each with one bucket per buffer and with buckets of about one
layer (``--bucket-size``). Memory: XLA's ``memory_analysis`` of the compiled step per device,
temp and argument bytes (deterministic). Time: median wall time of a step, the variants called
round-robin (simulated devices share the host's cores: the devices' work one after another).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEVICES, MICROBATCHES = 8, 4


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="timed steps per variant")
    p.add_argument("--bucket-size", type=int, default=250_000, help="elements per bucket of the bucketed variants")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    return p.parse_args()


def _variant(strategy: str, bucket_size: int | None):
    """(step, params, opt_state, batch) of the GPT under one strategy and bucket size."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from core import parallel_state as ps
    from core.distributed.distributed_data_parallel import DistributedDataParallel
    from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from core.models.gpt import GPTModel
    from core.optimizer import get_megatron_optimizer
    from core.optimizer.optimizer_config import OptimizerConfig
    from core.training.arguments import model_config, parse_args
    from core.training.train_step import make_train_step

    args = parse_args(["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
                       "--seq-length", "64"])
    state = ps.build_parallel_state()  # dp 8
    model = GPTModel(model_config(args), state)
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                                           grad_reduce_in_fp32=True, bucket_size=bucket_size)
    ddp = DistributedDataParallel(state, config, model)
    params = ddp.init(jax.random.key(0), jnp.zeros((1, args.seq_length), jnp.int32))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-4, clip_grad=1.0), [ddp])
    opt_state = optimizer.init_state(params)
    tokens = np.random.default_rng(0).integers(0, 1000, (DEVICES * MICROBATCHES, args.seq_length), np.int32)
    batch = ddp.shard_batch({"tokens": tokens, "labels": np.roll(tokens, -1, axis=1)})
    return make_train_step(ddp, optimizer, model.loss_fn, MICROBATCHES), params, opt_state, batch


def _memory(step, params, opt_state, batch) -> tuple[int, int]:
    analysis = step.lower(params, opt_state, batch).compile().memory_analysis()
    return analysis.temp_size_in_bytes, analysis.argument_size_in_bytes


def main() -> None:
    """Measure every variant and print (and with ``--out`` write) the table."""
    a = _args()
    from core.runtime.cpu_devices import configure_cpu_devices

    configure_cpu_devices(DEVICES)
    import jax

    variants = {(s, b): _variant(s, b) for b in (None, a.bucket_size) for s in ("optim", "optim_grads")}
    memory = {name: _memory(*v) for name, v in variants.items()}
    live = {name: [v[1], v[2]] for name, v in variants.items()}
    times: dict = {name: [] for name in variants}
    for i in range(a.rounds + 2):
        for name, (step, _, _, batch) in variants.items():
            start = time.perf_counter()
            params, opt_state, metrics = step(*live[name], batch)
            float(metrics["loss"])
            if i >= 2:  # compile and warm-up
                times[name].append(time.perf_counter() - start)
            live[name] = [params, opt_state]
    n_params = sum(x.size for x in jax.tree.leaves(next(iter(variants.values()))[1]))
    lines = [f"GPT {n_params / 1e6:.2f}M params (fp32, {4 * n_params / 2**20:.1f} MiB), dp {DEVICES} on simulated "
             f"CPU devices, {MICROBATCHES} microbatches, JAX {jax.__version__}; per device; median of {a.rounds} "
             "steps\n", "| strategy | buckets | temp MiB | argument MiB | temp + argument MiB | step ms |",
             "|---|---|---|---|---|---|"]
    for (strategy, bucket), (temp, arg) in memory.items():
        buckets = "one per buffer" if bucket is None else f"{bucket:,} elements"
        lines.append(f"| {strategy} | {buckets} | {temp / 2**20:.2f} | {arg / 2**20:.2f} | "
                     f"{(temp + arg) / 2**20:.2f} | {1e3 * statistics.median(times[strategy, bucket]):.0f} |")
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
