"""The distributed optimizer's fp32 param shard, built two ways side by side on one device (any
backend): from the params that overlap it (the package's ``flatten_bucket_shard``) and cut out
of the whole flat bucket with a ``dynamic_slice`` (the simpler alternative, for comparison).

    python bench/optimizer_shard.py                                    # CPU: hidden 512 x 4 layers
    python bench/optimizer_shard.py --hidden-size 2048 --num-layers 24 # a GPU: the ~1.2B GPT's params

The params are the GPT's (``launch/pretrain.py``'s shapes and flags, fp32) in the distributed
optimizer's buckets, and the rank is a traced index, as inside the step's ``shard_map``. Each
variant builds this rank's shard of every bucket and takes an AdamW update of it (the step's
use of the shard: the weight decay and the update both read it). Reported per number of shards:
XLA's ``memory_analysis`` temporaries of each variant (deterministic) and the median time of
``--reps`` calls made in alternation, with the ratio package / whole bucket. The two variants'
results are checked to be equal first.

Prints a table and writes ``bench/results/optimizer_shard.md`` (``--out``; not with ``--quick``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from core.atomic_files import write_text_atomically  # noqa: E402

MIB = 1024 * 1024
QUICK_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]


def gpt_params(model_flags: list[str]) -> list[Any]:
    """The GPT's initialized params for ``launch/pretrain.py``'s ``model_flags`` on one device (leaves)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps
    from core.models.gpt import GPTModel
    from core.param_metadata import init_sharded_params
    from core.training.arguments import model_config, parse_args

    args = parse_args(model_flags)
    state = ps.build_parallel_state(1, 1, devices=jax.devices()[:1])
    sample = jnp.zeros((1, args.seq_length), jnp.int32)
    params, _, _ = init_sharded_params(GPTModel(model_config(args), state).init, state.mesh,
                                       (jax.random.key(0), sample), (P(), P()))
    return [x.astype(jnp.float32) for x in jax.tree.leaves(params)]


def _adamw(shard: Any, grad: Any, m: Any, v: Any) -> tuple[Any, Any, Any]:
    """One AdamW update (optax's defaults, weight decay 0.1): what the step does with the shard."""
    import jax.numpy as jnp

    m = 0.9 * m + 0.1 * grad
    v = 0.999 * v + 0.001 * grad * grad
    return shard - 1e-3 * (m / (jnp.sqrt(v) + 1e-8) + 0.1 * shard), m, v


def variants(spec: Any, shards: int) -> dict[str, Any]:
    """name -> jitted ``f(leaves, grads, ms, vs, index)``: every bucket's updated shard, moments."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from core.distributed.param_and_grad_buffer import flatten_bucket, flatten_bucket_shard

    buckets = range(len(spec.layout.bucket_indices))

    def package(leaves, grads, ms, vs, index):
        return [_adamw(flatten_bucket_shard(leaves, spec, b, shards, index, jnp.float32), grads[b], ms[b], vs[b])
                for b in buckets]

    def whole_bucket(leaves, grads, ms, vs, index):
        out = []
        for b in buckets:
            flat = flatten_bucket(leaves, spec, b, jnp.float32)
            size = flat.shape[0] // shards
            out.append(_adamw(lax.dynamic_slice_in_dim(flat, index * size, size), grads[b], ms[b], vs[b]))
        return out

    return {"package": jax.jit(package), "whole bucket": jax.jit(whole_bucket)}


def measure(leaves: list[Any], shards: int, reps: int) -> dict[str, Any]:
    """One row: both variants' temporaries (MiB) and median ms at ``shards`` shards."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from core.distributed.param_and_grad_buffer import build_buffer_specs
    from core.param_metadata import ParamInfo

    shapes = [x.shape for x in leaves]
    spec = build_buffer_specs(shapes, [jnp.float32] * len(shapes), [ParamInfo(P())] * len(shapes),
                              data_parallel_size=shards, bucket_size=None, use_distributed_optimizer=True,
                              grad_reduce_in_fp32=False)[0]
    sizes = [n // shards for n in spec.bucket_sizes()]
    grads, ms, vs = ([jnp.full((n,), c, jnp.float32) for n in sizes] for c in (0.01, 0.0, 0.0))
    index = jnp.int32(shards - 1)  # the last shard: the end padding
    row: dict[str, Any] = {"shards": shards, "bucket_mib": sum(spec.bucket_sizes()) * 4 / MIB}
    calls, results = {}, {}
    for name, f in variants(spec, shards).items():
        compiled = f.lower(leaves, grads, ms, vs, index).compile()
        row[f"{name} temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / MIB
        calls[name], results[name] = compiled, jax.block_until_ready(compiled(leaves, grads, ms, vs, index))
    for a, b in zip(jax.tree.leaves(results["package"]), jax.tree.leaves(results["whole bucket"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, compiled in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(leaves, grads, ms, vs, index))
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        row[f"{name} ms"] = 1e3 * statistics.median(ts)
    row["ratio"] = row["package ms"] / row["whole bucket ms"]
    return row


def table(rows: list[dict[str, Any]], device: str) -> str:
    """The markdown table of :func:`measure`'s rows."""
    lines = [f"{device}; temporaries from XLA's memory_analysis, times median of alternated calls", "",
             "| shards | params (fp32 buckets) | temporaries: package / whole bucket | ms: package / whole bucket "
             "| time: package / whole bucket |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shards']} | {r['bucket_mib']:.1f} MiB | {r['package temp_mib']:.1f} / "
                     f"{r['whole bucket temp_mib']:.1f} MiB | {r['package ms']:.2f} / {r['whole bucket ms']:.2f} "
                     f"| {r['ratio']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark; returns the rows."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, a few calls: check the script")
    p.add_argument("--shards", default="2,8", help="numbers of shards (the distributed optimizer's dp)")
    p.add_argument("--reps", type=int, default=30, help="timed calls per variant")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "optimizer_shard.md"))
    a, model_flags = p.parse_known_args(argv)
    import jax

    leaves = gpt_params(QUICK_FLAGS if a.quick else ["--hidden-size", "512", "--num-attention-heads", "8",
                                                        *model_flags])
    rows = [measure(leaves, int(s), 2 if a.quick else a.reps) for s in a.shards.split(",")]
    device = jax.devices()[0]
    text = table(rows, f"{sum(x.size for x in leaves) / 1e6:.1f}M params, "
                       f"{device.platform} ({device.device_kind})")
    print(text)
    if not a.quick:
        write_text_atomically(a.out, f"# bench/optimizer_shard.py ({time.strftime('%Y-%m-%d')})\n\n{text}\n")
    return rows


if __name__ == "__main__":
    from core.runtime.cpu_malloc import reexec_with_malloc_settings

    reexec_with_malloc_settings()  # as the package's launch path does (CPU only)
    main()
