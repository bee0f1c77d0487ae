"""Data-parallel gradient reduction of bucketed buffers (Megatron's start/finish_grad_sync).

Runs inside ``shard_map``. Dense buffers reduce over the data-parallel x context-parallel
axes, expert buffers over the expert-data-parallel axis. Each bucket is one collective that
depends only on its own gradients:

* without the distributed optimizer: all-reduce, every rank gets every reduced gradient
  (:func:`reduce_gradients` returns them per parameter, Megatron's ``main_grad`` views). Where
  the collective is a plain ``psum`` (one process, GPUs, small buckets) it is one variadic
  all-reduce of the bucket's gradients, which needs no flat copy of them; on CPU across
  processes a large bucket is flattened and goes as ring reduce-scatter + all-gather
  (:func:`core.distributed.collectives.all_reduce`, ~0.6x gloo's all-reduce time);
* with it: reduce-scatter (:func:`core.distributed.collectives.reduce_scatter`) of the flat
  bucket, rank r keeps shard r of every bucket.

Scaling (see ``finalize_model_grads`` for the whole loss-normalisation contract): grads are
pre-multiplied by ``1/(dp*cp)`` and summed, or, with ``average_in_collective``, averaged in
the collective (expert buffers pre-scaled by ``edp/(dp*cp)`` so both give the same result).
With per-token normalisation (``num_tokens`` given to ``finalize_model_grads``) the factor
is 1 and the division by the global token count happens afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from core.distributed.collectives import all_reduce, default_all_reduce_impl, reduce_scatter
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.param_and_grad_buffer import (
    BufferSpec,
    flatten_bucket,
    flatten_to_buckets,
    unflatten_bucket,
)
from core.parallel_state import DP_AXIS, ParallelState

Buckets = tuple[jax.Array, ...]


def reduction_axes(spec: BufferSpec, state: ParallelState) -> tuple[str, ...]:
    """Mesh axes a buffer's gradients are reduced (and sharded) over."""
    if spec.key.is_expert_parallel:
        return state.axis_names(DP_AXIS)
    return state.data_parallel_with_context_axis_name


def axes_size(state: ParallelState, axes: Sequence[str]) -> int:
    """Number of devices along ``axes``."""
    size = 1
    for a in axes:
        size *= state.mesh.shape[a]
    return size


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
            elif ddp_config.use_distributed_optimizer:
                shard = reduce_scatter(g, axes)
                reduced.append(shard / group if average else shard)
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
    if ddp_config.use_distributed_optimizer:
        buffers = [flatten_to_buckets(grad_leaves, spec) for spec in specs]
        return reduce_gradient_buckets(buffers, specs, ddp_config, state, per_token_loss=per_token_loss)
    out = list(grad_leaves)
    for spec in specs:
        axes = reduction_axes(spec, state)
        group, scale, average = _scaling(spec, ddp_config, state, per_token_loss)
        dtype = jnp.dtype(spec.key.grad_dtype)
        for b in range(len(spec.layout.bucket_indices)):
            members = [spec.leaves[j] for j in spec.layout.bucket_params(b)]
            grads = {i: _prescale(out[i].astype(dtype), scale) for i in members}
            if group > 1:
                grads = _all_reduce_bucket(grads, spec, b, axes, average)
            for i, g in grads.items():
                out[i] = g
    return out
