"""Does a gradient all-reduce overlap independent compute on this backend?

    python bench/overlap.py                     # world sizes 2, 8; a 13 MiB all-reduce
    python bench/overlap.py --world-sizes 2 --mib 16 --reps 5

PyTorch DDP hides its bucket all-reduces behind the backward on a communication thread. In
JAX the same overlap has to come from the runtime: the all-reduce and compute that does not
depend on it, either in one executable (XLA may run independent ops concurrently) or as two
executables dispatched back to back (asynchronous dispatch). For each world size this prints
the all-reduce alone, a compute chain alone (matmuls of the GPT's size), both in one
``jit(shard_map)``, and both as two jitted calls, and the share of the shorter of the two that
was hidden: ``(ar + compute - both) / min(ar, compute)`` (1 = fully overlapped, 0 = serial).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpi_launch import emit, launch  # noqa: E402
from timing import median_seconds  # noqa: E402


def _compute(a):
    """A dependent chain of [1024, 1024] matmuls (~100 ms on one core)."""
    import jax.numpy as jnp

    x = a
    for _ in range(6):
        x = jnp.tanh(x @ a)
    return x


def worker(mib: int, reps: int) -> None:
    """Time the four variants; rank 0 prints one row."""
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps

    state = ps.initialize_model_parallel()
    axis, names = state.data_parallel_axis_name, state.mesh.axis_names
    spec = P(*names)

    def program(body, arity=1):
        specs = spec if arity == 1 else (spec,) * arity
        return jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=specs, out_specs=specs, check_vma=False))

    def reduce_body(g):
        return lax.psum(g, axis)

    def compute_body(a):
        return _compute(a.reshape(a.shape[-2:])).reshape(a.shape)

    def local(shape, value):
        data = np.full((1,) * len(names) + shape, value, np.float32)
        return jax.make_array_from_process_local_data(jax.NamedSharding(state.mesh, spec), data)

    grads = local((mib * 2**18,), 1.0)
    weights = local((1024, 1024), 1e-3)
    all_reduce, compute = program(reduce_body), program(compute_body)
    fused = program(lambda g, a: (reduce_body(g), compute_body(a)), arity=2)

    def two_calls(g, a):
        return all_reduce(g), compute(a)  # dispatched back to back, blocked on together

    row = {"world": state.world_size, "mib": mib,
           "all_reduce": median_seconds(all_reduce, grads, reps=reps),
           "compute": median_seconds(compute, weights, reps=reps),
           "one_executable": median_seconds(fused, grads, weights, reps=reps),
           "two_executables": median_seconds(two_calls, grads, weights, reps=reps)}
    if jax.process_index() == 0:
        emit(row)


def hidden_share(row: dict, both: float) -> float:
    """Fraction of the shorter of all-reduce and compute that ran concurrently with the other."""
    return (row["all_reduce"] + row["compute"] - both) / min(row["all_reduce"], row["compute"])


def main() -> None:
    """Parse flags; run as driver or worker."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,8")
    p.add_argument("--mib", type=int, default=13, help="all-reduce size in MiB (the e2e GPT's gradients: ~13)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.mib, args.reps)
    print("| world | all-reduce ms | compute ms | both, one executable ms (hidden) "
          "| both, two executables ms (hidden) |")
    print("|---|---|---|---|---|")
    for world in (int(w) for w in args.world_sizes.split(",")):
        (row,) = launch(__file__, world, ["--worker", "--mib", str(args.mib), "--reps", str(args.reps)], 900)
        one, two = row["one_executable"], row["two_executables"]
        print(f"| {world} | {row['all_reduce'] * 1e3:.1f} | {row['compute'] * 1e3:.1f} "
              f"| {one * 1e3:.1f} ({hidden_share(row, one):.0%}) | {two * 1e3:.1f} ({hidden_share(row, two):.0%}) |")


if __name__ == "__main__":
    main()
