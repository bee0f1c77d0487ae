"""TP MLP block step time: Megatron Column/Row layers vs xlstm_jax TPDense vs TPAsyncDense.

    python bench/tensor_parallel.py                     # one process, 8 simulated CPU devices
    mpirun -n 8 python bench/tensor_parallel.py         # one device per process (gloo)

For tp in {2, 4, 8} (data parallelism fills the rest of the 8 devices, each dp rank with the
same tokens), times one jitted forward+backward (grads of params and input) of an MLP block
``hidden -> 4*hidden -> hidden``: the median of ``--steps`` calls after a warm-up, printed as a
Markdown table with ratios against the Column/Row block.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import median_seconds  # noqa: E402


def main() -> None:
    """Parse flags, run every variant, print the table (rank 0)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tps", default="2,4,8")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices when run as one process")
    args = p.parse_args()

    import jax

    from core import parallel_state as ps

    if ps.mpi_world_size_from_env() > 1:
        ps.initialize_distributed()
    else:
        jax.config.update("jax_num_cpu_devices", args.devices)
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from core.param_metadata import init_sharded_params
    from core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPAsyncDense, TPDense

    h, f = args.hidden, 4 * args.hidden

    class Megatron(nn.Module):
        @nn.compact
        def __call__(self, x):
            y, _ = ColumnParallelLinear(h, f, name="fc1")(x)
            return RowParallelLinear(f, h, input_is_parallel=True, name="fc2")(nn.gelu(y))[0]

    class Xlstm(nn.Module):
        tp: int
        asynchronous: bool

        @nn.compact
        def __call__(self, x):
            layer = TPAsyncDense if self.asynchronous else TPDense
            up = layer(functools.partial(nn.Dense, features=f // self.tp), "tp", "gather", name="up")
            down_features = h // self.tp if self.asynchronous else h
            down = layer(functools.partial(nn.Dense, features=down_features), "tp", "scatter", name="down")
            return down(nn.gelu(up(x)))

    def step_time(state, module, x, x_spec):
        mesh = state.mesh
        params, specs, _ = init_sharded_params(module.init, mesh, (jax.random.key(0), x), (P(), x_spec))
        grad = jax.grad(lambda p, x: jnp.sum(module.apply(p, x) ** 2), argnums=(0, 1))
        fn = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(specs, x_spec), out_specs=(specs, x_spec),
                                   check_vma=False))
        return median_seconds(fn, params, x, reps=args.steps)

    x = np.random.default_rng(0).normal(size=(args.tokens, h)).astype(np.float32)
    rows = []
    for tp in (int(t) for t in args.tps.split(",")):
        state = ps.build_parallel_state(tp)
        base = step_time(state, Megatron(), x, P())
        sync = step_time(state, Xlstm(tp, False), x, P(None, "tp"))
        asyn = step_time(state, Xlstm(tp, True), x, P(None, "tp"))
        rows.append((tp, base, sync, asyn))
    if jax.process_index() == 0:
        where = f"{jax.process_count()} processes" if jax.process_count() > 1 else f"1 process, {args.devices} devices"
        print(f"TP MLP block {args.tokens} tokens x {h} -> {f} -> {h}, fwd+bwd, {where}, "
              f"{jax.devices()[0].platform}\n")
        print("| tp | Column/Row ms | TPDense ms | TPAsyncDense ms | TPDense / Column-Row "
              "| TPAsyncDense / Column-Row |")
        print("|---|---|---|---|---|---|")
        for tp, base, sync, asyn in rows:
            print(f"| {tp} | {base * 1e3:.1f} | {sync * 1e3:.1f} | {asyn * 1e3:.1f} | {sync / base:.2f} | "
                  f"{asyn / base:.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
