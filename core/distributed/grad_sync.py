"""Data-parallel gradient reduction of bucketed buffers (Megatron's start/finish_grad_sync).

Runs inside ``shard_map``. Dense buffers reduce over the data-parallel x context-parallel
axes, expert buffers over the expert-data-parallel axis. Each bucket is one collective that
depends only on its own gradients:

* without the distributed optimizer: all-reduce, every rank gets every reduced gradient
  (:func:`reduce_gradients` returns them per parameter, Megatron's ``main_grad`` views). Where
  the collective is a plain ``psum`` (one process, GPUs, small buckets) it is one variadic
  all-reduce of the bucket's gradients, which needs no flat copy of them; on CPU across
  processes a large bucket is flattened and goes as ring reduce-scatter + all-gather
  (:func:`core.distributed.collectives.all_reduce`, faster than gloo's all-reduce);
* with it: reduce-scatter (:func:`core.distributed.collectives.reduce_scatter`) of the flat
  bucket, rank r keeps shard r of every bucket;
* with the partial distributed optimizer (``num_distributed_optimizer_instances`` = I > 1):
  Megatron's two levels. The group's n ranks form I instances of g = n/I contiguous ranks
  (Megatron's intra-partial groups ``ranks[i*g:(i+1)*g]`` of the dp-cp group); the bucket is
  reduce-scattered inside the instance (g shards, rank keeps shard ``r mod g``), then each shard
  is all-reduced across the instances (the inter groups ``ranks[j::g]``, whose members hold the
  same shard). Both are real sub-group collectives (``axis_index_groups``); the result is the
  full sum, bit-identical on the I holders of a shard;
* with ``reduce_scatter_with_fp32_accumulation``: the reduce-scatter is an all-to-all in the
  grad dtype plus a local fp32 sum, cast back to the grad dtype
  (:func:`core.distributed.collectives.reduce_scatter_with_fp32_accumulation`);
* parameters sharded over data parallelism (Megatron-FSDP ``optim_grads_params``, buffers whose
  key says ``fsdp_sharded``): no collective here, the model's per-unit gathers reduce-scattered
  their grads already (:mod:`core.distributed.fsdp`); they are only scaled. With HSDP (the
  parallel state's outer data-parallel axis, one index per distributed-optimizer instance) those
  reduce-scatters summed inside the instance, and a ``psum`` over the outer axis adds the instances.

Scaling (see ``finalize_model_grads`` for the whole loss-normalisation contract): grads are
pre-multiplied by ``1/(dp*cp)`` and summed, or, with ``average_in_collective``, averaged in
the collective (expert buffers pre-scaled by ``edp/(dp*cp)`` so both give the same result).
With per-token normalisation (``num_tokens`` given to ``finalize_model_grads``) the factor
is 1 and the division by the global token count happens afterwards.

``check_for_large_grads`` (:func:`check_for_large_grads`): Megatron's per-bucket check of the
local gradient norm *before* the collective, with the rerun state machine's
``is_unexpectedly_large(threshold=10, context="grads")``: per rank, the first
``LARGE_GRAD_NUM_SAMPLES`` (100) finite bucket norms only set the reference max (never
flagged); after them the max is frozen and a norm ``>= 10 x max`` is flagged. NaN/Inf norms
are neither counted nor flagged (``check_for_nan_in_grad`` handles them).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from core.distributed.collectives import (
    all_reduce,
    default_all_reduce_impl,
    reduce_scatter,
    reduce_scatter_with_fp32_accumulation,
)
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.param_and_grad_buffer import (
    BufferSpec,
    flatten_bucket,
    flatten_to_buckets,
    unflatten_bucket,
)
from core.parallel_state import ParallelState

Buckets = tuple[jax.Array, ...]


def reduction_axes(spec: BufferSpec, state: ParallelState) -> tuple[str, ...]:
    """Mesh axes a buffer's gradients are reduced (and sharded) over."""
    return state.replica_axes(spec.key.is_expert_parallel)


def axes_size(state: ParallelState, axes: Sequence[str]) -> int:
    """Number of devices along ``axes``."""
    size = 1
    for a in axes:
        size *= state.mesh.shape[a]
    return size


def instance_groups(group_size: int, num_instances: int) -> tuple[list[list[int]] | None, list[list[int]] | None]:
    """(intra-instance, inter-instance) ``axis_index_groups`` of a reduction group of ``group_size``
    ranks split into ``num_instances`` distributed-optimizer instances, Megatron's layout: intra
    groups are contiguous blocks ``[i*g, (i+1)*g)``, inter groups the ranks ``j, j+g, ...`` that
    hold the same shard. ``(None, None)`` for one instance. Raises ``ValueError`` if it does not divide."""
    if num_instances == 1:
        return None, None
    if group_size % num_instances:
        raise ValueError(f"data-parallel group of {group_size} ranks is not divisible by "
                         f"num_distributed_optimizer_instances={num_instances}")
    g = group_size // num_instances
    return ([list(range(i * g, (i + 1) * g)) for i in range(num_instances)],
            [list(range(j, group_size, g)) for j in range(g)])


def distributed_optimizer_groups(spec: BufferSpec, ddp_config: DistributedDataParallelConfig,
                                 state: ParallelState) -> tuple[list[list[int]] | None, list[list[int]] | None]:
    """:func:`instance_groups` of a buffer's reduction group (over :func:`reduction_axes`)."""
    return instance_groups(axes_size(state, reduction_axes(spec, state)),
                           ddp_config.num_distributed_optimizer_instances)


def _scaling(spec: BufferSpec, ddp_config: DistributedDataParallelConfig, state: ParallelState,
             per_token_loss: bool) -> tuple[int, float, bool]:
    """(group size, pre-scale factor, average in the collective?) of a buffer's reduction."""
    dp_cp = state.data_parallel_size * state.context_parallel_size
    group = axes_size(state, reduction_axes(spec, state))
    if per_token_loss:
        return group, 1.0, False
    if ddp_config.average_in_collective:
        return group, group / dp_cp, True
    return group, 1.0 / dp_cp, False


def _prescale(x: jax.Array, scale: float) -> jax.Array:
    return x * scale if scale != 1.0 else x


def reduce_gradient_buckets(
    buffers: Sequence[Buckets],
    specs: Sequence[BufferSpec],
    ddp_config: DistributedDataParallelConfig,
    state: ParallelState,
    *,
    per_token_loss: bool = False,
) -> tuple[Buckets, ...]:
    """Reduce every flat bucket of every buffer over its data-parallel group.

    Returns full reduced buckets, or this rank's shard of each bucket with the distributed
    optimizer.
    """
    out = []
    for spec, buckets in zip(specs, buffers, strict=True):
        axes = reduction_axes(spec, state)
        group, scale, average = _scaling(spec, ddp_config, state, per_token_loss)
        reduced = []
        for bucket in buckets:
            g = _prescale(bucket, scale)
            if group == 1:
                reduced.append(g)
            elif ddp_config.shards_optimizer_state:
                intra, inter = distributed_optimizer_groups(spec, ddp_config, state)
                if ddp_config.reduce_scatter_with_fp32_accumulation:
                    shard = reduce_scatter_with_fp32_accumulation(g, axes, axis_index_groups=intra)
                    shard = (shard / group if average else shard).astype(g.dtype)
                else:
                    shard = reduce_scatter(g, axes, axis_index_groups=intra)
                    if inter is not None:
                        shard = all_reduce(shard, axes, axis_index_groups=inter)
                    shard = shard / group if average else shard
                reduced.append(shard)
            else:
                reduced.append(all_reduce(g, axes, average=average))
        out.append(tuple(reduced))
    return tuple(out)


def _all_reduce_bucket(grads: dict[int, jax.Array], spec: BufferSpec, bucket: int, axes: tuple[str, ...],
                       average: bool) -> dict[int, jax.Array]:
    """One collective for one bucket's (pre-scaled) gradients ``{leaf index: grad}``."""
    nbytes = sum(g.size * g.dtype.itemsize for g in grads.values())
    if default_all_reduce_impl(nbytes, lax.axis_size(axes)) == "psum":
        return (lax.pmean if average else lax.psum)(grads, axes)  # XLA's combiner merges the psums
    flat = flatten_bucket(grads, spec, bucket)  # the split all-reduce moves one flat buffer
    return unflatten_bucket(all_reduce(flat, axes, average=average), spec, bucket)


def reduce_gradients(
    grad_leaves: Sequence[jax.Array],
    specs: Sequence[BufferSpec],
    ddp_config: DistributedDataParallelConfig,
    state: ParallelState,
    *,
    per_token_loss: bool = False,
) -> list[jax.Array] | tuple[Buckets, ...]:
    """Reduce every parameter's gradient over its data-parallel group, one collective per bucket.

    ``grad_leaves``: this device's gradients in flattened-tree order. Returns, with the
    distributed optimizer, this rank's shard of every flat bucket (per buffer, as
    :func:`reduce_gradient_buckets`); without it the reduced gradient of every leaf, in the
    buffer's grad dtype.
    """
    if ddp_config.shards_optimizer_state:
        buffers = [flatten_to_buckets(grad_leaves, spec) for spec in specs]
        return reduce_gradient_buckets(buffers, specs, ddp_config, state, per_token_loss=per_token_loss)
    out = list(grad_leaves)
    for spec in specs:
        axes = reduction_axes(spec, state)
        group, scale, average = _scaling(spec, ddp_config, state, per_token_loss)
        dtype = jnp.dtype(spec.key.grad_dtype)
        if spec.key.fsdp_sharded:  # summed over the leaf's fsdp axes by the gathers' reduce-scatters already
            scale = scale / group if average else scale
            grads = {i: _prescale(out[i].astype(dtype), scale) for i in spec.leaves}
            # HSDP: the gathers reduce-scattered inside an instance; add the instances' sums.
            outer = tuple(a for a in state.data_parallel_outer_axis_name if a in axes and state.mesh.shape[a] > 1)
            if outer and grads:
                grads = lax.psum(grads, outer)
            for i, g in grads.items():
                out[i] = g
            continue
        for b in range(len(spec.layout.bucket_indices)):
            members = [spec.leaves[j] for j in spec.layout.bucket_params(b)]
            grads = {i: _prescale(out[i].astype(dtype), scale) for i in members}
            if group > 1:
                grads = _all_reduce_bucket(grads, spec, b, axes, average)
            for i, g in grads.items():
                out[i] = g
    return out


# ---------------------------------------------------------------------------------------
# check_for_large_grads: Megatron's is_unexpectedly_large on each bucket's local grad norm
# ---------------------------------------------------------------------------------------

LARGE_GRAD_THRESHOLD = 10.0
"""A bucket norm ``>=`` this multiple of the reference max is large (Megatron's ``threshold=10``)."""
LARGE_GRAD_NUM_SAMPLES = 100
"""Finite bucket norms per rank that set the reference max before any is checked (Megatron's
``num_samples`` default)."""


def checked_buckets(specs: Sequence[BufferSpec]) -> list[tuple[int, int]]:
    """``(buffer index, bucket index)`` of every bucket in the order the check visits them: dense
    buffers first, then expert ones (Megatron's ``bucket_groups + expert_parallel_bucket_groups``)."""
    order = sorted(range(len(specs)), key=lambda i: specs[i].key.is_expert_parallel)
    return [(i, b) for i in order for b in range(len(specs[i].layout.bucket_indices))]


def init_large_grad_tracker() -> dict[str, jax.Array]:
    """This rank's running state of the check: finite norms seen so far (capped at the sample
    count) and their max."""
    return {"count": jnp.zeros((), jnp.int32), "max": jnp.zeros((), jnp.float32)}


def local_bucket_norms(grad_leaves: Sequence[jax.Array], specs: Sequence[BufferSpec]) -> jax.Array:
    """fp32 L2 norm of every bucket of this rank's local (unreduced) grads, :func:`checked_buckets` order."""
    norms = []
    for i, b in checked_buckets(specs):
        spec = specs[i]
        members = [spec.leaves[j] for j in spec.layout.bucket_params(b)]
        sumsq = sum((jnp.sum(jnp.square(grad_leaves[k].astype(jnp.float32))) for k in members),
                    jnp.zeros((), jnp.float32))
        norms.append(jnp.sqrt(sumsq))
    return jnp.stack(norms) if norms else jnp.zeros(0, jnp.float32)


def check_for_large_grads(
    tracker: dict[str, jax.Array], grad_leaves: Sequence[jax.Array], specs: Sequence[BufferSpec],
    state: ParallelState, *, threshold: float = LARGE_GRAD_THRESHOLD, num_samples: int = LARGE_GRAD_NUM_SAMPLES,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array], jax.Array]:
    """Megatron's ``check_grads(check_for_large=True)`` on this rank's local grads (inside ``shard_map``).

    Visits the buckets in :func:`checked_buckets` order, as Megatron calls
    ``is_unexpectedly_large`` once per bucket: a finite norm while fewer than ``num_samples``
    have been seen raises the reference max and is not flagged; afterwards a norm ``>=
    threshold x max`` is flagged. Returns (new tracker, report ``{"flags", "norms", "max"}``
    of this rank, whether any bucket on any rank was flagged). The last value needs one scalar
    all-reduce over every mesh axis.
    """
    count, ref = tracker["count"], tracker["max"]
    norms = local_bucket_norms(grad_leaves, specs)
    flags = []
    for k in range(norms.shape[0]):
        v = norms[k]
        finite = jnp.isfinite(v)
        warming = count < num_samples
        flags.append(finite & ~warming & (v >= ref * threshold))
        ref = jnp.where(finite & warming, jnp.maximum(ref, v), ref)
        count = count + (finite & warming).astype(jnp.int32)
    flags = jnp.stack(flags) if flags else jnp.zeros(0, bool)
    axes = tuple(a for a in state.mesh.axis_names if state.mesh.shape[a] > 1)
    local_any = jnp.any(flags).astype(jnp.int32)
    any_large = (lax.psum(local_any, axes) if axes else local_any) > 0
    return {"count": count, "max": ref}, {"flags": flags, "norms": norms, "max": ref}, any_large


class LargeGradientError(RuntimeError):
    """``check_for_large_grads`` flagged a bucket (Megatron's rerun state machine raises a
    ``RuntimeError`` for a rejected result when reruns are disabled)."""


def large_grads_message(report: dict[str, np.ndarray], specs: Sequence[BufferSpec], param_paths: Sequence[str],
                        device_ranks: Sequence[int]) -> str:
    """One message naming every flagged (rank, bucket), its norm, the reference max and the bucket's
    params, from the ``large_grads`` metric gathered to the host (arrays with a leading axis of one
    entry per device, ``device_ranks`` the global rank of each)."""
    buckets = checked_buckets(specs)
    parts = []
    for d, k in zip(*np.nonzero(report["flags"]), strict=True):
        i, b = buckets[k]
        names = [param_paths[specs[i].leaves[j]] for j in specs[i].layout.bucket_params(b)]
        shown = ", ".join(f"params{n}" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        parts.append(f"rank {int(device_ranks[d])}: bucket #{b} of the {specs[i].key.grad_dtype}"
                     f"{' expert' if specs[i].key.is_expert_parallel else ''} buffer, local grad norm "
                     f"{float(report['norms'][d, k]):.4g} >= {LARGE_GRAD_THRESHOLD:g} x {float(report['max'][d]):.4g} "
                     f"({shown})")
    return (f"unexpectedly large local gradients before the data-parallel collective ({len(parts)} rank/bucket "
            f"pairs): {'; '.join(parts[:10])}. The update was skipped; parameters and optimizer state are "
            "unchanged.")
