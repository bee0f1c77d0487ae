"""Data-parallel gradient reduction of bucketed buffers (Megatron's start/finish_grad_sync).

Runs inside ``shard_map``. Dense buffers reduce over the data-parallel x context-parallel
axes, expert buffers over the expert-data-parallel axis. Each bucket is one collective that
depends only on its own gradients:

* without the distributed optimizer: all-reduce (:func:`core.distributed.collectives.all_reduce`:
  on CPU across processes a large bucket goes as ring reduce-scatter + all-gather, ~0.6x gloo's
  all-reduce time), every rank gets the whole reduced bucket;
* with it: reduce-scatter (:func:`core.distributed.collectives.reduce_scatter`), rank r keeps
  shard r of every bucket.

Scaling (see ``finalize_model_grads`` for the whole loss-normalisation contract): grads are
pre-multiplied by ``1/(dp*cp)`` and summed, or, with ``average_in_collective``, averaged in
the collective (expert buffers pre-scaled by ``edp/(dp*cp)`` so both give the same result).
With per-token normalisation (``num_tokens`` given to ``finalize_model_grads``) the factor
is 1 and the division by the global token count happens afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from core.distributed.collectives import all_reduce, reduce_scatter
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.param_and_grad_buffer import BufferSpec
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


def reduce_gradient_buckets(
    buffers: Sequence[Buckets],
    specs: Sequence[BufferSpec],
    ddp_config: DistributedDataParallelConfig,
    state: ParallelState,
    *,
    per_token_loss: bool = False,
) -> tuple[Buckets, ...]:
    """Reduce every bucket of every buffer over its data-parallel group.

    Returns full reduced buckets, or this rank's shard of each bucket with the distributed
    optimizer.
    """
    dp_cp = state.data_parallel_size * state.context_parallel_size
    out = []
    for spec, buckets in zip(specs, buffers, strict=True):
        axes = reduction_axes(spec, state)
        group = axes_size(state, axes)
        if per_token_loss:
            scale, average = 1.0, False
        elif ddp_config.average_in_collective:
            scale, average = group / dp_cp, True
        else:
            scale, average = 1.0 / dp_cp, False
        reduced = []
        for bucket in buckets:
            g = bucket * scale if scale != 1.0 else bucket
            if group == 1:
                reduced.append(g)
            elif ddp_config.use_distributed_optimizer:
                shard = reduce_scatter(g, axes)
                reduced.append(shard / group if average else shard)
            else:
                reduced.append(all_reduce(g, axes, average=average))
        out.append(tuple(reduced))
    return tuple(out)
