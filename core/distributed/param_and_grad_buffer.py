"""Contiguous, bucketed gradient buffers: Megatron's layout rules as pure functions.

A *buffer* holds the gradients of every parameter with the same (param dtype, grad dtype,
expert?) key, laid out in reverse model order (roughly the order backprop produces them)
and cut into *buckets*; each bucket is reduced by one collective. In JAX a buffer is a
tuple of 1-D bucket arrays (the contiguous buffer is their concatenation): keeping buckets
separate lets each bucket's collective depend only on its own parameters' gradients.

Layout rules (Megatron-core ``_ParamAndGradBuffer``):

* params are placed in reverse order; a bucket closes once it holds ``>= bucket_size``
  elements, so a parameter never spans two buckets;
* without the distributed optimizer there is no padding;
* with it, each parameter start is aligned to 64 elements, each bucket end is padded to
  ``lcm(dp, 128)`` (``lcm(dp, 128, 2**16)`` with ``pad_buckets_for_high_nccl_busbw``), so
  every bucket splits into ``dp`` equal shards, and a shared-embedding parameter gets a
  bucket of its own;
* unlike Megatron, a bucket never exceeds ``MAX_BUCKET_ELEMENTS`` (padding included): the
  distributed optimizer finds its shard and the checkpoint conversions their elements with int32
  index arithmetic inside a bucket (JAX's default integer), which would wrap silently above
  2**31. Below that (every buffer of a model under ~2.1B parameters per device) the layout is
  Megatron's; above it a buffer that would be one bucket becomes several.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from core.param_metadata import ParamInfo

PARAM_ALIGNMENT = 64
BUCKET_ALIGNMENT = 128
HIGH_BUSBW_ALIGNMENT = 2**16
MAX_BUCKET_ELEMENTS = 2**31 - 2**20
"""The most elements of one bucket, padding included: int32 indexing, with headroom for the
index arithmetic on positions inside a bucket (offsets from a shard's start, a few increments)."""


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where every parameter and bucket lives in one flat buffer."""

    param_index_map: tuple[tuple[int, int, int], ...]
    """Entry i: (start, end, bucket_id) of parameter i (model order)."""
    bucket_indices: tuple[tuple[int, int], ...]
    """(start, end) of every bucket, padding included."""
    per_bucket_numel_unpadded: tuple[int, ...]
    """Elements of every bucket before its end padding."""

    @property
    def numel(self) -> int:
        """Total (padded) buffer size."""
        return self.bucket_indices[-1][1] if self.bucket_indices else 0

    def bucket_params(self, bucket_id: int) -> list[int]:
        """Parameter indices in ``bucket_id``, in buffer order."""
        members = [i for i, (_, _, b) in enumerate(self.param_index_map) if b == bucket_id]
        return sorted(members, key=lambda i: self.param_index_map[i][0])


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor  # integers: exact at any size


def build_param_layout(
    numels: Sequence[int],
    *,
    bucket_size: int | None,
    data_parallel_size: int,
    use_distributed_optimizer: bool,
    shared_embedding: int | Sequence[int] | None = None,
    pad_buckets_for_high_nccl_busbw: bool = False,
    max_bucket_elements: int | None = None,
) -> ParamLayout:
    """Megatron's buffer layout for parameters of ``numels`` (model order); see module docstring.

    ``shared_embedding`` is the index (or indices) of shared-embedding parameters;
    ``max_bucket_elements`` (default ``MAX_BUCKET_ELEMENTS``) caps a padded bucket: a parameter
    that would take its bucket past it starts a new one, and one that does not fit alone is a
    ``ValueError``.
    """
    limit = MAX_BUCKET_ELEMENTS if max_bucket_elements is None else max_bucket_elements
    shared = set() if shared_embedding is None else (
        {shared_embedding} if isinstance(shared_embedding, int) else set(shared_embedding))
    divisor = 1
    if use_distributed_optimizer:
        divisor = math.lcm(data_parallel_size, BUCKET_ALIGNMENT)
        if pad_buckets_for_high_nccl_busbw:
            divisor = math.lcm(divisor, HIGH_BUSBW_ALIGNMENT)
    index_map: dict[int, tuple[int, int, int]] = {}
    buckets: list[tuple[int, int]] = []
    unpadded: list[int] = []
    bucket_start = param_start = 0
    bucket_members = 0

    def close_bucket(end: int) -> int:
        nonlocal bucket_start, bucket_members
        unpadded.append(end - bucket_start)
        padded_end = _pad(end, divisor)
        buckets.append((bucket_start, padded_end))
        bucket_start, bucket_members = padded_end, 0
        return padded_end

    for i in reversed(range(len(numels))):
        own_bucket = use_distributed_optimizer and i in shared
        if use_distributed_optimizer:
            param_start = _pad(param_start, PARAM_ALIGNMENT)
        param_end = param_start + int(numels[i])
        if (own_bucket or _pad(param_end, divisor) - bucket_start > limit) and bucket_members:
            param_start = close_bucket(param_start)
            param_end = param_start + int(numels[i])
        if _pad(param_end, divisor) - bucket_start > limit:
            raise ValueError(f"a parameter of {int(numels[i])} elements (on each device) does not fit in a gradient "
                             f"bucket: buckets are indexed with int32, at most {limit} elements; split it over more "
                             f"devices (tensor or expert model parallelism)")
        index_map[i] = (param_start, param_end, len(buckets))
        bucket_members += 1
        if (bucket_size is not None and param_end - bucket_start >= bucket_size) or own_bucket:
            param_start = close_bucket(param_end)
        else:
            param_start = param_end
    if bucket_members:
        close_bucket(param_end)
    return ParamLayout(tuple(index_map[i] for i in range(len(numels))), tuple(buckets), tuple(unpadded))


# ---------------------------------------------------------------------------------------
# Buffers: grouping parameters, flattening into buckets and back
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BufferKey:
    """What parameters share one buffer (Megatron's ``BufferKey``)."""

    param_dtype: str
    """Parameter dtype name."""
    grad_dtype: str
    """Gradient (buffer) dtype name: fp32 with grad_reduce_in_fp32, else the param dtype."""
    is_expert_parallel: bool
    """Expert parameters reduce over the expert-data-parallel group."""
    fsdp_sharded: bool = False
    """Parameters sharded over data parallelism (Megatron-FSDP ``optim_grads_params``): their grads
    arrive reduced (the gathers' transposes reduce-scatter them), the buffer only scales them."""


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """One buffer: which parameters (leaf indices of the param tree) and their layout."""

    key: BufferKey
    """The buffer's dtypes and group."""
    leaves: tuple[int, ...]
    """Indices (into the flattened param tree) of this buffer's params, in model order."""
    shapes: tuple[tuple[int, ...], ...]
    """Local shape of each of those params."""
    layout: ParamLayout
    """Their positions and buckets."""

    def bucket_sizes(self) -> list[int]:
        """Padded size of every bucket."""
        return [end - start for start, end in self.layout.bucket_indices]


def build_buffer_specs(
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[jnp.dtype],
    infos: Sequence[ParamInfo],
    *,
    data_parallel_size: int,
    bucket_size: int | None,
    use_distributed_optimizer: bool,
    grad_reduce_in_fp32: bool,
    pad_buckets_for_high_nccl_busbw: bool = False,
) -> tuple[BufferSpec, ...]:
    """Group parameters (flattened tree order = model order) into buffers and lay each out."""
    groups: dict[BufferKey, list[int]] = {}
    for i, (dtype, info) in enumerate(zip(dtypes, infos, strict=True)):
        param_dtype = jnp.dtype(dtype).name
        grad_dtype = "float32" if grad_reduce_in_fp32 else param_dtype
        groups.setdefault(BufferKey(param_dtype, grad_dtype, info.expert, info.fsdp_sharded), []).append(i)
    specs = []
    for key, leaves in groups.items():
        numels = [int(np.prod(shapes[i])) for i in leaves]
        shared = [j for j, i in enumerate(leaves) if infos[i].shared_embedding]
        # FSDP-sharded parameters are never flattened into their buckets by the fused step (their
        # grads arrive reduced, leaf by leaf): the int32 cap on a bucket does not apply to them.
        layout = build_param_layout(
            numels, bucket_size=bucket_size, data_parallel_size=data_parallel_size,
            use_distributed_optimizer=use_distributed_optimizer, shared_embedding=shared,
            pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
            max_bucket_elements=sys.maxsize if key.fsdp_sharded else None,
        )
        specs.append(BufferSpec(key, tuple(leaves), tuple(tuple(shapes[i]) for i in leaves), layout))
    return tuple(specs)


def flatten_bucket(leaves: Sequence[jax.Array], spec: BufferSpec, bucket: int, dtype=None) -> jax.Array:
    """Bucket ``bucket`` of this buffer as one padded 1-D array of its params' values (default
    dtype: the grad dtype). ``leaves`` is the whole flattened tree; only the bucket's params are read."""
    dtype = jnp.dtype(spec.key.grad_dtype if dtype is None else dtype)
    return _flatten_runs(leaves, spec, _runs(spec, bucket, *spec.layout.bucket_indices[bucket]), dtype)


def _runs(spec: BufferSpec, bucket: int, lo: int, hi: int) -> list[tuple[int, int, int | None, int]]:
    """``[lo, hi)`` of ``bucket`` (buffer offsets) as runs ``(start, end, param j or None for a
    gap or padding, offset of start in param j)``, in order."""
    runs, cursor = [], lo
    for j in spec.layout.bucket_params(bucket):
        p_start, p_end, _ = spec.layout.param_index_map[j]
        start, end = max(p_start, lo), min(p_end, hi)
        if start < end:
            if start > cursor:
                runs.append((cursor, start, None, 0))
            runs.append((start, end, j, start - p_start))
            cursor = end
    if hi > cursor:
        runs.append((cursor, hi, None, 0))
    return runs


def _run_values(leaves: Sequence[jax.Array], spec: BufferSpec, run: tuple[int, int, int | None, int],
                dtype: Any, start: int | None = None, end: int | None = None) -> jax.Array:
    """The values of ``run`` (a :func:`_runs` entry) at buffer offsets ``[start, end)`` inside it
    (default: all of it)."""
    r_start, r_end, j, offset = run
    start, end = r_start if start is None else start, r_end if end is None else end
    if j is None:
        return jnp.zeros(end - start, dtype)
    flat = jnp.ravel(leaves[spec.leaves[j]])
    lo = offset + start - r_start
    return (flat if (lo, end - start) == (0, flat.shape[0]) else flat[lo:lo + end - start]).astype(dtype)


def _flatten_runs(leaves: Sequence[jax.Array], spec: BufferSpec, runs: Sequence[tuple[int, int, int | None, int]],
                  dtype: Any) -> jax.Array:
    """The values of consecutive :func:`_runs` entries as one 1-D array."""
    pieces = [_run_values(leaves, spec, run, dtype) for run in runs]
    return jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]


SHARD_SEGMENT_MAX_SLICES = 2048
"""Most static slices (segments x shards) with which :func:`flatten_bucket_shard` builds a
shard segment by segment; beyond, it selects between whole candidate shards, which costs
O(params + shards) slices. Tracing and compiling the segments take time in proportion to their
slices: seconds for a bucket of a few tens of params cut into hundreds of shards, where the
candidates take a fraction of a second (``bench/results/2026-11-ddp-optimizer-cpu.md``)."""


def flatten_bucket_shard(leaves: Sequence[jax.Array], spec: BufferSpec, bucket: int, shards: int,
                         index: jax.Array, dtype=None) -> jax.Array:
    """Shard ``index`` (a traced rank) of ``shards`` equal shards of :func:`flatten_bucket`'s
    result, without the whole bucket. The shard is cut into segments at every offset where some
    rank's shard crosses a parameter boundary; in each segment every rank's values are one static
    slice of one parameter (or zeros), and ``lax.select_n`` picks the rank's. Cutting the shard out
    of the whole bucket with a ``dynamic_slice`` makes XLA keep the whole fp32 bucket as a
    temporary of the distributed optimizer's step (its shard has several consumers): about one
    fp32 copy of the params per device. Selecting between whole candidate shards instead (each a
    concatenation) fuses into the update, which the CPU then runs markedly slower than the cut
    (every candidate evaluated per element); per segment, XLA writes the shard once. With
    many shards the segments' slices grow as segments x shards: beyond
    :data:`SHARD_SEGMENT_MAX_SLICES` the candidates are used (a GPU's fused loop reads the bucket
    once either way)."""
    dtype = jnp.dtype(spec.key.grad_dtype if dtype is None else dtype)
    start, end = spec.layout.bucket_indices[bucket]
    size = (end - start) // shards
    if shards == 1:
        return flatten_bucket(leaves, spec, bucket, dtype)
    runs = [_runs(spec, bucket, start + k * size, start + (k + 1) * size) for k in range(shards)]
    cuts = sorted({0, size} | {r[0] - (start + k * size) for k, rs in enumerate(runs) for r in rs})
    if (len(cuts) - 1) * shards > SHARD_SEGMENT_MAX_SLICES:  # many ranks: whole candidates, fused
        return lax.select_n(index, *(_flatten_runs(leaves, spec, rs, dtype) for rs in runs))
    segments, at = [], [0] * shards  # at[k]: the run of shard k holding the current segment
    for lo, hi in zip(cuts, cuts[1:]):
        values = []
        for k in range(shards):
            base = start + k * size
            while runs[k][at[k]][1] <= base + lo:
                at[k] += 1
            values.append(_run_values(leaves, spec, runs[k][at[k]], dtype, base + lo, base + hi))
        segments.append(lax.select_n(index, *values))
    return jnp.concatenate(segments) if len(segments) > 1 else segments[0]


def unflatten_bucket(flat: jax.Array, spec: BufferSpec, bucket: int, dtype=None) -> dict[int, jax.Array]:
    """Inverse of :func:`flatten_bucket`: ``{leaf index: array of its local shape}`` of the bucket's params."""
    offset = spec.layout.bucket_indices[bucket][0]
    out = {}
    for j in spec.layout.bucket_params(bucket):
        start, end, _ = spec.layout.param_index_map[j]
        value = flat[start - offset:end - offset].reshape(spec.shapes[j])
        out[spec.leaves[j]] = value if dtype is None else value.astype(dtype)
    return out


def flatten_to_buckets(leaves: Sequence[jax.Array], spec: BufferSpec, dtype=None) -> tuple[jax.Array, ...]:
    """This buffer's params' values (e.g. grads) as padded 1-D buckets (default: the grad dtype).

    ``leaves`` is the whole flattened tree; only ``spec.leaves`` are used. Each bucket is built
    from its own parameters only.
    """
    return tuple(flatten_bucket(leaves, spec, b, dtype) for b in range(len(spec.layout.bucket_indices)))


def unflatten_from_buckets(buckets: Sequence[jax.Array], spec: BufferSpec, dtype=None) -> dict[int, jax.Array]:
    """Inverse of :func:`flatten_to_buckets`: ``{leaf index: array of its local shape}``."""
    out = {}
    for b, flat in enumerate(buckets):
        out.update(unflatten_bucket(flat, spec, b, dtype))
    return out


def bucket_shard_ranges(layout: ParamLayout, data_parallel_size: int, rank: int) -> list[tuple[int, int]]:
    """Distributed optimizer: the ``(start, end)`` buffer range ``rank`` owns in every bucket.

    Rank r owns ``[start + r*n/dp, start + (r+1)*n/dp)`` of each bucket of ``n`` elements,
    ignoring parameter boundaries.
    """
    ranges = []
    for start, end in layout.bucket_indices:
        n = end - start
        if n % data_parallel_size:
            raise ValueError(f"bucket of {n} elements does not split into {data_parallel_size} shards")
        shard = n // data_parallel_size
        ranges.append((start + rank * shard, start + (rank + 1) * shard))
    return ranges


def bucket_flag_changes(spec: BufferSpec, bucket: int, per_param: Sequence[bool]) -> tuple[bool, tuple[int, ...]]:
    """A per-parameter flag over ``bucket`` as runs: ``(flag of its first element, offsets in the
    bucket where the flag flips)``, each parameter's elements with its flag (``per_param``,
    indexed like ``spec.leaves``). Alignment gaps and end padding take the flag of the parameter
    before them: their values and gradients are zero, so any flag does, and fewer flips are
    fewer comparisons where the flags are computed (the distributed optimizer's step)."""
    start = spec.layout.bucket_indices[bucket][0]
    members = spec.layout.bucket_params(bucket)
    first = bool(per_param[members[0]]) if members else False
    flips, current = [], first
    for j in members:
        if bool(per_param[j]) != current:
            flips.append(spec.layout.param_index_map[j][0] - start)
            current = not current
    return first, tuple(flips)


def bucket_element_masks(spec: BufferSpec, per_param: Sequence[bool]) -> tuple[np.ndarray, ...]:
    """Per-bucket boolean arrays: True on the elements of params whose ``per_param`` flag is set.

    ``per_param`` is indexed like ``spec.leaves``. Padding is False.
    """
    masks = []
    for b, (start, end) in enumerate(spec.layout.bucket_indices):
        mask = np.zeros(end - start, bool)
        for j in spec.layout.bucket_params(b):
            if per_param[j]:
                p_start, p_end, _ = spec.layout.param_index_map[j]
                mask[p_start - start:p_end - start] = True
        masks.append(mask)
    return tuple(masks)
