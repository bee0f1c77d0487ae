"""DDP step time vs the tutorial's per-leaf ``pmean`` data parallelism, optimizer-state bytes,
and bucket collectives vs their stand-alone time.

    python bench/ddp.py                  # mpirun -n 8, a GPT-like model of ~60 param arrays
    python bench/ddp.py --world-sizes 2,4,8 --steps 5

All variants train the same model on the same global batch with AdamW, inside one mpirun:

* ``pmean per leaf``: ``jit(shard_map)`` step, ``lax.pmean`` of every gradient leaf, optax;
* ``DDP all-reduce``: this package, one bucket and several buckets;
* ``DDP distributed optimizer``: reduce-scatter buckets, sharded Adam state, all-gather;
* ``DDP partial distributed optimizer, 2 instances`` (``num_distributed_optimizer_instances=2``):
  the state sharded over world/2 ranks, reduce-scatter inside each half, all-reduce across.

Step time is the median of ``--steps`` timed steps after two warm-up steps. The bucket check
times the DDP's gradient reduction alone (one jitted program reducing every bucket, as in
the step) against the sum of each bucket's collective run stand-alone.

The reduce-scatter traffic check reduces one bucket of the model's size with bf16 grads three
ways (fp32 buffers as with ``grad_reduce_in_fp32``; a plain bf16 reduce-scatter;
``reduce_scatter_with_fp32_accumulation``) and reports the bytes each device sends, counted
from the compiled program's collectives (``hlo_collective_bytes``), next to the ring formula
for the dtype the program asks for, and the reduction's time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpi_launch import emit, launch  # noqa: E402
from timing import median_seconds  # noqa: E402


def build_model(layers: int, hidden: int, vocab: int):
    """A small GPT-like decoder (embedding, pre-norm attention + MLP blocks, tied output)."""
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm(name="ln1")(x)
            q, k, v = jnp.split(nn.Dense(3 * hidden, name="qkv")(h), 3, axis=-1)
            heads = lambda t: t.reshape(t.shape[:2] + (4, hidden // 4))
            att = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / (hidden // 4) ** 0.5
            mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
            att = jnp.where(mask, att, -1e9)
            out = jnp.einsum("bhqk,bkhd->bqhd", nn.softmax(att, axis=-1), heads(v)).reshape(x.shape)
            x = x + nn.Dense(hidden, name="proj")(out)
            h = nn.LayerNorm(name="ln2")(x)
            return x + nn.Dense(hidden, name="fc2")(nn.gelu(nn.Dense(4 * hidden, name="fc1")(h)))

    class Gpt(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            emb = nn.Embed(vocab, hidden, name="embedding")
            x = emb(tokens)
            for i in range(layers):
                x = Block(name=f"layer_{i:02d}")(x)
            return emb.attend(nn.LayerNorm(name="final_ln")(x))

    return Gpt()


def worker(args) -> None:
    """Run every variant in this mpirun job; rank 0 emits rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps
    from core.distributed.collectives import hlo_collective_bytes
    from core.distributed.distributed_data_parallel import DistributedDataParallel
    from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from core.distributed.grad_sync import reduce_gradient_buckets
    from core.distributed.param_and_grad_buffer import build_buffer_specs
    from core.optimizer import get_megatron_optimizer
    from core.optimizer.optimizer_config import OptimizerConfig
    from core.param_metadata import ParamInfo
    from core.training.train_step import make_train_step

    state = ps.initialize_model_parallel()
    world, rank = state.world_size, jax.process_index()
    model = build_model(args.layers, args.hidden, args.vocab)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, size=(args.global_batch, args.seq + 1)).astype(np.int32)
    per = args.global_batch // world
    local = tokens[rank * per:(rank + 1) * per]

    def loss_fn(params, batch):
        logits = model.apply(params, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    cfg = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01)

    def timed(step, params, opt_state, batch):
        for _ in range(2):
            params, opt_state, _ = step(params, opt_state, batch)
        jax.block_until_ready(params)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            params, opt_state, _ = step(params, opt_state, batch)
            jax.block_until_ready(params)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    results = {}
    # The tutorial recipe: pmean every gradient leaf, optax on replicated params.
    ddp0 = DistributedDataParallel(state, DistributedDataParallelConfig(), model)
    params0 = ddp0.init(jax.random.key(0), jnp.asarray(local[:1, :-1]))
    numel = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params0))
    tx = optax.adamw(1e-3, weight_decay=0.01)
    dp_axes = state.data_parallel_axis_name

    def tutorial_step(params, opt_state, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        g = jax.tree.map(lambda x: lax.pmean(x, dp_axes), g)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, dp_axes)

    tstep = jax.jit(jax.shard_map(tutorial_step, mesh=state.mesh, in_specs=(P(), P(), P(dp_axes)),
                                  out_specs=(P(), P(), P()), check_vma=False))
    batch = ddp0.shard_batch(local)
    results["pmean per leaf"] = (timed(tstep, params0, jax.jit(tx.init)(params0), batch), None)

    bucket = max(numel // args.buckets, 1)
    variants = {
        "DDP all-reduce, 1 bucket": DistributedDataParallelConfig(),
        f"DDP all-reduce, {args.buckets} buckets": DistributedDataParallelConfig(bucket_size=bucket),
        "DDP distributed optimizer, 1 bucket": DistributedDataParallelConfig(use_distributed_optimizer=True),
        f"DDP distributed optimizer, {args.buckets} buckets": DistributedDataParallelConfig(
            use_distributed_optimizer=True, bucket_size=bucket),
    }
    if world % 2 == 0:
        variants["DDP partial distributed optimizer, 2 instances, 1 bucket"] = DistributedDataParallelConfig(
            use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    last = None
    for name, ddp_config in variants.items():
        ddp = DistributedDataParallel(state, ddp_config, model)
        opt = get_megatron_optimizer(cfg, [ddp])
        params = ddp.init(jax.random.key(0), jnp.asarray(local[:1, :-1]))
        opt_state = opt.init_state(params)
        nbytes = opt.state_bytes_per_device(opt_state)
        results[name] = (timed(make_train_step(ddp, opt, loss_fn), params, opt_state, batch), nbytes)
        if ddp_config.num_distributed_optimizer_instances == 1:
            last = ddp
    if rank == 0:
        base = results["pmean per leaf"][0]
        for name, (seconds, nbytes) in results.items():
            emit({"world": world, "variant": name, "step_s": seconds, "vs_pmean": seconds / base,
                  "opt_state_bytes": nbytes, "params": numel})

    # Bucket collectives of the last variant (distributed optimizer, several buckets).
    specs = last.buffer_specs
    local_spec = P(tuple(state.mesh.axis_names))
    zeros = lambda sizes: tuple(jnp.zeros((world, n), jnp.float32) for n in sizes)

    def reduce_all(*buckets):
        b = tuple(x[0] for x in buckets)
        out = reduce_gradient_buckets([b], specs[:1], last.ddp_config, state)[0]
        return tuple(x[None] for x in out)

    sizes = specs[0].bucket_sizes()
    together = jax.jit(jax.shard_map(reduce_all, mesh=state.mesh, in_specs=local_spec, out_specs=local_spec,
                                     check_vma=False))

    sharding = jax.NamedSharding(state.mesh, local_spec)
    arrays = [jax.device_put(x, sharding) for x in zeros(sizes)]
    in_step = median_seconds(together, *arrays, reps=args.steps)
    alone = 0.0
    for i in range(len(sizes)):
        single = jax.jit(jax.shard_map(lambda x, i=i: reduce_gradient_buckets(
            [tuple(x[0] if j == i else jnp.zeros((sizes[j],)) for j in range(len(sizes)))], specs[:1],
            last.ddp_config, state)[0][i][None], mesh=state.mesh, in_specs=local_spec, out_specs=local_spec,
            check_vma=False))
        alone += median_seconds(single, arrays[i], reps=args.steps)
    if rank == 0:
        emit({"world": world, "buckets": sizes, "together_s": in_step, "sum_alone_s": alone})

    # Reduce-scatter of one bf16 bucket of the model's size: bytes on the wire and time.
    for name, ddp_config, wire_itemsize in [
        ("fp32 buffer (grad_reduce_in_fp32)", DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True), 4),
        ("bf16 buffer, plain reduce-scatter", DistributedDataParallelConfig(use_distributed_optimizer=True), 2),
        ("bf16 buffer, reduce_scatter_with_fp32_accumulation", DistributedDataParallelConfig(
            use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=True), 2),
    ]:
        spec = build_buffer_specs([(numel,)], [jnp.bfloat16], [ParamInfo(P())], data_parallel_size=world,
                                  bucket_size=None, use_distributed_optimizer=True,
                                  grad_reduce_in_fp32=ddp_config.grad_reduce_in_fp32)
        size = spec[0].bucket_sizes()[0]
        dtype = jnp.dtype(spec[0].key.grad_dtype)
        fn = jax.jit(jax.shard_map(
            lambda x, spec=spec, c=ddp_config: reduce_gradient_buckets([(x[0],)], spec, c, state)[0][0][None],
            mesh=state.mesh, in_specs=local_spec, out_specs=local_spec, check_vma=False))
        x = jax.device_put(jnp.ones((world, size), dtype), sharding)
        wire = hlo_collective_bytes(fn.lower(x).compile().as_text(), world)
        seconds = median_seconds(fn, x, reps=args.steps)
        if rank == 0:
            emit({"world": world, "reduce_scatter": name, "elements": size, "hlo_bytes": sum(wire.values()),
                  "ops": sorted(wire), "ring_bytes": wire_itemsize * size * (world - 1) // world, "rs_s": seconds})


def main() -> None:
    """Driver: run the worker for each world size and print the tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="8")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--buckets", type=int, default=4, help="target number of buckets for the bucketed variants")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("world_sizes", "worker")]
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        rows += launch(__file__, world, ["--worker", *passthrough], 3600)
    print("| world | variant | step ms | vs pmean per leaf | optimizer state per device |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "variant" in r:
            nbytes = "-" if r["opt_state_bytes"] is None else f"{r['opt_state_bytes'] / 2**20:.1f} MiB"
            print(f"| {r['world']} | {r['variant']} | {r['step_s'] * 1e3:.1f} | {r['vs_pmean']:.2f} | {nbytes} |")
    print()
    print("| world | bucket sizes (elements) | all buckets in one program ms | sum of stand-alone ms | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "buckets" in r:
            print(f"| {r['world']} | {r['buckets']} | {r['together_s'] * 1e3:.1f} | {r['sum_alone_s'] * 1e3:.1f} "
                  f"| {r['together_s'] / r['sum_alone_s']:.2f} |")
    print()
    print("| world | bf16 bucket reduce-scatter | elements | bytes sent per device, compiled HLO | ring formula, "
          "program dtype | collectives | ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "reduce_scatter" in r:
            print(f"| {r['world']} | {r['reduce_scatter']} | {r['elements']} | {r['hlo_bytes'] / 2**20:.2f} MiB "
                  f"| {r['ring_bytes'] / 2**20:.2f} MiB | {', '.join(r['ops'])} | {r['rs_s'] * 1e3:.1f} |")
    params = next(r["params"] for r in rows if "params" in r)
    print(f"\nmodel: {params / 1e6:.2f}M params; Adam state of the replicated optimizer = 8 bytes/param "
          f"({8 * params / 2**20:.1f} MiB) per device")


if __name__ == "__main__":
    main()
