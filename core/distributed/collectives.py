"""Backend-aware collectives for gradient buckets, used inside ``jax.shard_map``.

Why not plain ``lax.psum_scatter``: on JAX's CPU backend across processes (gloo over TCP), a
*small* reduce-scatter leaves the connections in a state where every later large all-reduce
or all-gather crawls at about 1 MB/s until a large reduce-scatter happens (README, known
issues; ``bench/collectives.py``, ``bench/results/2026-11-collectives-cpu.md``). Gradient
buckets end with a small bucket often, so the DDP must never issue a small gloo
reduce-scatter. On CPU multi-process runs :func:`reduce_scatter` therefore uses a ring of
``ppermute`` steps (same traffic as an optimal reduce-scatter, no stall); elsewhere (GPU/NCCL,
single-process CPU) it is ``lax.psum_scatter``.

For the same backend :func:`all_reduce` sends large buffers as that ring reduce-scatter plus
an all-gather: gloo's own ring all-reduce moves them more slowly, and XLA's CPU runtime cannot
hide it behind compute (``bench/overlap.py``), so its speed is what the step pays.

All functions take an ``axis_name`` that may be a tuple of mesh axes (e.g. the data-parallel
``("dp", "ep")``); ranks along a tuple are numbered with the first axis major, as
``lax.axis_index`` does.

Sub-groups (the partial distributed optimizer's intra- and inter-instance groups): every
function takes ``axis_index_groups``, a partition of the ranks along ``axis_name`` into
equal-size groups (lists of those rank numbers); the collective then runs inside each group
separately, as over a Megatron process group of those ranks. It maps to XLA's
``replica_groups`` (``lax.psum``/``psum_scatter``/``all_gather``/``all_to_all`` with
``axis_index_groups``, which ``shard_map`` accepts on JAX 0.10.2, tested in one process and
across gloo processes), and the ring implementations permute inside each group.

:func:`reduce_scatter_with_fp32_accumulation` is Megatron's reduce-scatter for low-precision
grads: an all-to-all of the inputs in their own dtype (bf16 on the wire, the traffic of a ring
reduce-scatter), then a local fp32 sum of the received chunks. :func:`hlo_collective_bytes`
counts the bytes one device sends in a compiled program's collectives.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

AxisName = str | tuple[str, ...]
AxisIndexGroups = Sequence[Sequence[int]] | None
ReduceScatterImpl = Literal["auto", "psum_scatter", "ring", "all_reduce"]
AllReduceImpl = Literal["auto", "psum", "reduce_scatter_all_gather"]


def default_reduce_scatter_impl() -> ReduceScatterImpl:
    """The reduce-scatter implementation :func:`reduce_scatter` uses with ``impl="auto"``."""
    if jax.default_backend() == "cpu" and jax.process_count() > 1:
        return "ring"
    return "psum_scatter"


def _groups(axis_index_groups: AxisIndexGroups) -> list[list[int]] | None:
    return None if axis_index_groups is None else [list(map(int, g)) for g in axis_index_groups]


def group_size(axis_name: AxisName, axis_index_groups: AxisIndexGroups = None) -> int:
    """Ranks taking part in one collective: the axis size, or the size of one group (all equal)."""
    if axis_index_groups is None:
        return lax.axis_size(axis_name)
    sizes = {len(g) for g in axis_index_groups}
    if len(sizes) != 1:
        raise ValueError(f"axis_index_groups must all have the same size, got sizes {sorted(sizes)}")
    return sizes.pop()


def group_index(axis_name: AxisName, axis_index_groups: AxisIndexGroups = None) -> jax.Array:
    """This rank's position inside its group (``lax.axis_index`` without groups)."""
    me = lax.axis_index(axis_name)
    if axis_index_groups is None:
        return me
    position = np.zeros(sum(len(g) for g in axis_index_groups), np.int32)
    for g in axis_index_groups:
        for p, r in enumerate(g):
            position[r] = p
    return jnp.asarray(position)[me]


def _ring_reduce_scatter(x: jax.Array, axis_name: AxisName, dim: int,
                         axis_index_groups: AxisIndexGroups = None) -> jax.Array:
    """Ring reduce-scatter: n-1 ppermute steps, each moving one 1/n chunk to the next rank of the group."""
    n = group_size(axis_name, axis_index_groups)
    chunk = x.shape[dim] // n
    chunks = jnp.moveaxis(x, dim, 0).reshape((n, chunk) + tuple(s for i, s in enumerate(x.shape) if i != dim))
    me = group_index(axis_name, axis_index_groups)
    groups = _groups(axis_index_groups) or [list(range(n))]
    to_next = [(g[i], g[(i + 1) % n]) for g in groups for i in range(n)]
    # Partial sum of chunk c travels c+1, c+2, ... and completes on group rank c after n-1 hops.
    acc = chunks[(me - 1) % n]
    for step in range(1, n):
        acc = lax.ppermute(acc, axis_name, to_next)
        acc = acc + chunks[(me - step - 1) % n]
    return jnp.moveaxis(acc, 0, dim)


def _all_reduce_reduce_scatter(x: jax.Array, axis_name: AxisName, dim: int,
                               axis_index_groups: AxisIndexGroups = None) -> jax.Array:
    """All-reduce then keep this rank's slice (twice the traffic, but one collective)."""
    n = group_size(axis_name, axis_index_groups)
    chunk = x.shape[dim] // n
    full = lax.psum(x, axis_name, axis_index_groups=_groups(axis_index_groups))
    return lax.dynamic_slice_in_dim(full, group_index(axis_name, axis_index_groups) * chunk, chunk, axis=dim)


def reduce_scatter(
    x: jax.Array, axis_name: AxisName, *, scatter_dimension: int = 0, impl: ReduceScatterImpl = "auto",
    axis_index_groups: AxisIndexGroups = None,
) -> jax.Array:
    """Sum ``x`` over ``axis_name`` and return this rank's contiguous chunk along ``scatter_dimension``.

    Rank ``r`` gets ``sum[r*k:(r+1)*k]`` with ``k = x.shape[dim] / axis_size`` (tiled, like
    ``psum_scatter(..., tiled=True)``). Raises ``ValueError`` if the dimension does not divide.
    With ``axis_index_groups`` the sum and the chunks are per group (``r``: the position in it).
    """
    n = group_size(axis_name, axis_index_groups)
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
        return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True,
                                axis_index_groups=_groups(axis_index_groups))
    if impl == "ring":
        return _ring_reduce_scatter(x, axis_name, dim, axis_index_groups)
    if impl == "all_reduce":
        return _all_reduce_reduce_scatter(x, axis_name, dim, axis_index_groups)
    raise ValueError(f"unknown reduce_scatter impl {impl!r}")


def reduce_scatter_with_fp32_accumulation(x: jax.Array, axis_name: AxisName, *,
                                          axis_index_groups: AxisIndexGroups = None) -> jax.Array:
    """Reduce-scatter of a 1-D ``x`` that sends ``x``'s dtype over the wire but sums in fp32.

    Megatron's ``reduce_scatter_with_fp32_accumulation``: an all-to-all gives every rank the
    ``n`` chunks of its shard (one from each rank, in ``x``'s dtype: each rank sends
    ``(n-1)/n`` of ``x``, as a ring reduce-scatter does), which are then summed locally in
    fp32. Returns the float32 sum (the caller casts it, Megatron copies it into the bf16 grad
    shard), so the result has one rounding instead of one per ring step. Narrow floats travel
    bit-cast to same-width integers (XLA:CPU would otherwise send bf16 as f32).
    """
    n = group_size(axis_name, axis_index_groups)
    if x.ndim != 1 or x.shape[0] % n:
        raise ValueError(f"reduce_scatter_with_fp32_accumulation: needs a 1-D array whose size is divisible by "
                         f"{n}, got shape {x.shape}")
    if n == 1:
        return x.astype(jnp.float32)
    chunks = x.reshape(n, -1)
    groups = _groups(axis_index_groups)
    wire = {2: jnp.uint16, 1: jnp.uint8}.get(x.dtype.itemsize) if jnp.issubdtype(x.dtype, jnp.floating) else None
    if wire is not None:
        # XLA:CPU runs bf16/f16 collectives in f32 (4 bytes on the wire, seen in the compiled HLO);
        # the all-to-all only moves data, so move the raw bits as same-width integers (a free bitcast).
        bits = lax.all_to_all(lax.bitcast_convert_type(chunks, wire), axis_name, 0, 0, tiled=True,
                              axis_index_groups=groups)
        received = lax.bitcast_convert_type(bits, x.dtype)
    else:
        received = lax.all_to_all(chunks, axis_name, 0, 0, tiled=True, axis_index_groups=groups)
    # Explicit adds in rank order: XLA:CPU fuses them into one loop (a reduce over the leading axis
    # of the received [n, chunk] block is far slower there).
    total = received[0].astype(jnp.float32)
    for i in range(1, n):
        total = total + received[i].astype(jnp.float32)
    return total


def all_gather(x: jax.Array, axis_name: AxisName, *, axis: int = 0,
               axis_index_groups: AxisIndexGroups = None) -> jax.Array:
    """Concatenate every rank's ``x`` along ``axis`` in rank order (tiled all-gather), per group
    with ``axis_index_groups``."""
    if group_size(axis_name, axis_index_groups) == 1:
        return x
    return lax.all_gather(x, axis_name, axis=axis, tiled=True, axis_index_groups=_groups(axis_index_groups))


# Below this size gloo's own all-reduce is as fast as reduce-scatter + all-gather (two
# collectives, 2(n-1) latency-bound steps); above it the split is faster
# (bench/results/2026-11-collectives-cpu.md).
SPLIT_ALL_REDUCE_MIN_BYTES = 4 * 2**20
# With two ranks both are one exchange of halves each way and take about the same time, so the
# split gains nothing there and its flat copy of the gradients costs a pass over them.
SPLIT_ALL_REDUCE_MIN_RANKS = 3


def default_all_reduce_impl(nbytes: int, ranks: int = SPLIT_ALL_REDUCE_MIN_RANKS) -> AllReduceImpl:
    """The all-reduce implementation :func:`all_reduce` uses with ``impl="auto"`` for ``nbytes``
    over ``ranks`` devices: the split one for large buffers over 3 or more ranks on a
    multi-process CPU run, one ``psum`` otherwise."""
    if (jax.default_backend() == "cpu" and jax.process_count() > 1 and nbytes >= SPLIT_ALL_REDUCE_MIN_BYTES
            and ranks >= SPLIT_ALL_REDUCE_MIN_RANKS):
        return "reduce_scatter_all_gather"
    return "psum"


def _split_all_reduce(x: jax.Array, axis_name: AxisName, axis_index_groups: AxisIndexGroups = None) -> jax.Array:
    """Sum as a ring reduce-scatter of the flattened ``x`` (padded to a multiple of the axis
    size) followed by a tiled all-gather: every element is summed once, on its chunk's owner,
    so all ranks get bit-identical results."""
    n = group_size(axis_name, axis_index_groups)
    flat = x.reshape(-1)
    pad = -flat.size % n
    if pad:
        flat = jnp.pad(flat, (0, pad))
    full = all_gather(_ring_reduce_scatter(flat, axis_name, 0, axis_index_groups), axis_name,
                      axis_index_groups=axis_index_groups)
    return (full[: x.size] if pad else full).reshape(x.shape)


def all_reduce(
    x: jax.Array, axis_name: AxisName, *, average: bool = False, impl: AllReduceImpl = "auto",
    axis_index_groups: AxisIndexGroups = None,
) -> jax.Array:
    """Sum (or average) ``x`` over ``axis_name``.

    ``impl="psum"`` is one ``lax.psum``; ``"reduce_scatter_all_gather"`` is the package's ring
    reduce-scatter then an all-gather, which on CPU across processes moves a large buffer faster
    than gloo's ring all-reduce (``bench/results/2026-11-collectives-cpu.md``). ``"auto"`` picks
    the split for buffers of at least ``SPLIT_ALL_REDUCE_MIN_BYTES`` over at least
    ``SPLIT_ALL_REDUCE_MIN_RANKS`` ranks on a multi-process CPU run and ``psum`` otherwise. With
    ``axis_index_groups`` each group sums its own ranks' values.
    """
    n = group_size(axis_name, axis_index_groups)
    if n == 1:
        return x
    impl = default_all_reduce_impl(x.size * x.dtype.itemsize, n) if impl == "auto" else impl
    if impl == "psum":
        total = lax.psum(x, axis_name, axis_index_groups=_groups(axis_index_groups))
        return total / n if average else total
    if impl == "reduce_scatter_all_gather":
        total = _split_all_reduce(x, axis_name, axis_index_groups)
        return total / n if average else total
    raise ValueError(f"unknown all_reduce impl {impl!r}")


# ---------------------------------------------------------------------------------------
# Traffic of a compiled program's collectives
# ---------------------------------------------------------------------------------------

_HLO_COLLECTIVE = re.compile(
    r"=\s*(?P<type>\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
    r"(?P<rest>.*)$")
_HLO_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_HLO_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_HLO_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")


_HLO_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                 "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def _hlo_bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _HLO_ARRAY.findall(type_text):
        itemsize = 1 if dtype.startswith("f8") else _HLO_ITEMSIZE.get(dtype, 0)
        total += itemsize * (math.prod(int(d) for d in dims.split(",") if d) if dims else 1)
    return total


def hlo_collective_bytes(hlo_text: str, num_devices: int) -> dict[str, int]:
    """Bytes one device sends over the wire in each kind of collective of a compiled HLO module
    (``jitted.lower(...).compile().as_text()``), with the bandwidth-optimal ring formulas for a
    group of ``n`` (from ``replica_groups``; ``num_devices`` when absent) and a result of ``B``
    bytes: all-reduce ``2B(n-1)/n``, all-gather ``B(n-1)/n``, reduce-scatter ``nB(n-1)/n``
    (its operand is ``n`` results), all-to-all ``B(n-1)/n``, collective-permute ``B`` (one
    send per device and permute). Keys: the HLO op names; values rounded to ints."""
    out: dict[str, float] = {}
    for line in hlo_text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)
        m = _HLO_COLLECTIVE.search(line)
        if not m or "-done(" in line:
            continue
        op, nbytes = m.group("op"), _hlo_bytes(m.group("type"))
        n = num_devices
        if (iota := _HLO_IOTA_GROUPS.search(line)) is not None:
            n = int(iota.group(2))
        elif (listed := _HLO_LIST_GROUPS.search(line)) is not None:
            n = len([r for r in listed.group(1).split(",") if r])
        if op == "collective-permute":
            sent = nbytes
        elif n <= 1:
            sent = 0
        elif op == "all-reduce":
            sent = 2 * nbytes * (n - 1) / n
        elif op == "reduce-scatter":
            sent = nbytes * (n - 1)
        else:  # all-gather (result = n inputs) and all-to-all (result = input)
            sent = nbytes * (n - 1) / n
        out[op] = out.get(op, 0) + sent
    return {k: int(round(v)) for k, v in out.items()}
