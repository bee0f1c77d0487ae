"""Backend-aware collectives for gradient buckets, used inside ``jax.shard_map``.

Why not plain ``lax.psum_scatter``: on JAX's CPU backend across processes (gloo over TCP), a
*small* reduce-scatter leaves the connections in a state where every later large all-reduce
or all-gather crawls at about 1 MB/s (4 MiB all-reduce: 0.05 s -> 15 s) until a large
reduce-scatter happens (see README, known issues, and ``bench/collectives.py``). Gradient
buckets end with a small bucket often, so the DDP must never issue a small gloo
reduce-scatter. On CPU multi-process runs :func:`reduce_scatter` therefore uses a ring of
``ppermute`` steps (same traffic as an optimal reduce-scatter, no stall); elsewhere (GPU/NCCL,
single-process CPU) it is ``lax.psum_scatter``.

For the same backend :func:`all_reduce` sends large buffers as that ring reduce-scatter plus
an all-gather: gloo's own ring all-reduce moves them at ~0.6x the speed (a 13 MiB gradient
bucket at 8 processes: 127 vs 73 ms), and XLA's CPU runtime cannot hide it behind compute
(``bench/overlap.py``), so its speed is what the step pays.

All functions take an ``axis_name`` that may be a tuple of mesh axes (e.g. the data-parallel
``("dp", "ep")``); ranks along a tuple are numbered with the first axis major, as
``lax.axis_index`` does.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

AxisName = str | tuple[str, ...]
ReduceScatterImpl = Literal["auto", "psum_scatter", "ring", "all_reduce"]
AllReduceImpl = Literal["auto", "psum", "reduce_scatter_all_gather"]


def default_reduce_scatter_impl() -> ReduceScatterImpl:
    """The reduce-scatter implementation :func:`reduce_scatter` uses with ``impl="auto"``."""
    if jax.default_backend() == "cpu" and jax.process_count() > 1:
        return "ring"
    return "psum_scatter"


def _ring_reduce_scatter(x: jax.Array, axis_name: AxisName, dim: int) -> jax.Array:
    """Ring reduce-scatter: n-1 ppermute steps, each moving one 1/n chunk to the next rank."""
    n = lax.axis_size(axis_name)
    chunk = x.shape[dim] // n
    chunks = jnp.moveaxis(x, dim, 0).reshape((n, chunk) + tuple(s for i, s in enumerate(x.shape) if i != dim))
    me = lax.axis_index(axis_name)
    to_next = [(i, (i + 1) % n) for i in range(n)]
    # Partial sum of chunk c travels c+1, c+2, ... and completes on rank c after n-1 hops.
    acc = chunks[(me - 1) % n]
    for step in range(1, n):
        acc = lax.ppermute(acc, axis_name, to_next)
        acc = acc + chunks[(me - step - 1) % n]
    return jnp.moveaxis(acc, 0, dim)


def _all_reduce_reduce_scatter(x: jax.Array, axis_name: AxisName, dim: int) -> jax.Array:
    """All-reduce then keep this rank's slice (twice the traffic, but one collective)."""
    n = lax.axis_size(axis_name)
    chunk = x.shape[dim] // n
    full = lax.psum(x, axis_name)
    return lax.dynamic_slice_in_dim(full, lax.axis_index(axis_name) * chunk, chunk, axis=dim)


def reduce_scatter(
    x: jax.Array, axis_name: AxisName, *, scatter_dimension: int = 0, impl: ReduceScatterImpl = "auto"
) -> jax.Array:
    """Sum ``x`` over ``axis_name`` and return this rank's contiguous chunk along ``scatter_dimension``.

    Rank ``r`` gets ``sum[r*k:(r+1)*k]`` with ``k = x.shape[dim] / axis_size`` (tiled, like
    ``psum_scatter(..., tiled=True)``). Raises ``ValueError`` if the dimension does not divide.
    """
    n = lax.axis_size(axis_name)
    dim = scatter_dimension % x.ndim
    if x.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter: dimension {dim} of size {x.shape[dim]} is not divisible by the "
            f"size {n} of axis {axis_name!r}"
        )
    if n == 1:
        return x
    impl = default_reduce_scatter_impl() if impl == "auto" else impl
    if impl == "psum_scatter":
        return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)
    if impl == "ring":
        return _ring_reduce_scatter(x, axis_name, dim)
    if impl == "all_reduce":
        return _all_reduce_reduce_scatter(x, axis_name, dim)
    raise ValueError(f"unknown reduce_scatter impl {impl!r}")


def all_gather(x: jax.Array, axis_name: AxisName, *, axis: int = 0) -> jax.Array:
    """Concatenate every rank's ``x`` along ``axis`` in rank order (tiled all-gather)."""
    if lax.axis_size(axis_name) == 1:
        return x
    return lax.all_gather(x, axis_name, axis=axis, tiled=True)


# Below this size gloo's own all-reduce is as fast as reduce-scatter + all-gather (two
# collectives, 2(n-1) latency-bound steps); measured on CPU at 8 processes: 1 MiB 26 vs 39 ms,
# 4 MiB 40 vs 39 ms, 13 MiB 127 vs 73 ms (bench/collectives.py, README).
SPLIT_ALL_REDUCE_MIN_BYTES = 4 * 2**20
# With two ranks both are one exchange of halves each way: 16 MiB 16.7 ms as one all-reduce,
# 9.4 + 7.5 ms split (bench/collectives.py), so the split gains nothing there and its flat copy
# of the gradients costs a pass over them.
SPLIT_ALL_REDUCE_MIN_RANKS = 3


def default_all_reduce_impl(nbytes: int, ranks: int = SPLIT_ALL_REDUCE_MIN_RANKS) -> AllReduceImpl:
    """The all-reduce implementation :func:`all_reduce` uses with ``impl="auto"`` for ``nbytes``
    over ``ranks`` devices: the split one for large buffers over 3 or more ranks on a
    multi-process CPU run, one ``psum`` otherwise."""
    if (jax.default_backend() == "cpu" and jax.process_count() > 1 and nbytes >= SPLIT_ALL_REDUCE_MIN_BYTES
            and ranks >= SPLIT_ALL_REDUCE_MIN_RANKS):
        return "reduce_scatter_all_gather"
    return "psum"


def _split_all_reduce(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Sum as a ring reduce-scatter of the flattened ``x`` (padded to a multiple of the axis
    size) followed by a tiled all-gather: every element is summed once, on its chunk's owner,
    so all ranks get bit-identical results."""
    n = lax.axis_size(axis_name)
    flat = x.reshape(-1)
    pad = -flat.size % n
    if pad:
        flat = jnp.pad(flat, (0, pad))
    full = lax.all_gather(_ring_reduce_scatter(flat, axis_name, 0), axis_name, tiled=True)
    return (full[: x.size] if pad else full).reshape(x.shape)


def all_reduce(
    x: jax.Array, axis_name: AxisName, *, average: bool = False, impl: AllReduceImpl = "auto"
) -> jax.Array:
    """Sum (or average) ``x`` over ``axis_name``.

    ``impl="psum"`` is one ``lax.psum``; ``"reduce_scatter_all_gather"`` is the package's ring
    reduce-scatter then an all-gather, which on CPU across processes moves a large buffer in
    ~0.6x gloo's all-reduce time (gloo's ring all-reduce at 8 processes: 13 MiB in 127 ms, the
    split one in 73 ms). ``"auto"`` picks the split for buffers of at least
    ``SPLIT_ALL_REDUCE_MIN_BYTES`` over at least ``SPLIT_ALL_REDUCE_MIN_RANKS`` ranks on a
    multi-process CPU run and ``psum`` otherwise.
    """
    n = lax.axis_size(axis_name)
    if n == 1:
        return x
    impl = default_all_reduce_impl(x.size * x.dtype.itemsize, n) if impl == "auto" else impl
    if impl == "psum":
        return lax.pmean(x, axis_name) if average else lax.psum(x, axis_name)
    if impl == "reduce_scatter_all_gather":
        total = _split_all_reduce(x, axis_name)
        return total / n if average else total
    raise ValueError(f"unknown all_reduce impl {impl!r}")
