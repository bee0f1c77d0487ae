"""Global gradient norm across every rank, and clipping by it (Megatron's ``clip_grads``).

Every gradient element must be counted exactly once in the global norm, although copies of
it live on several devices. Each element is counted once:

* tensor-parallel-split params on every tp rank (each holds a different slice), tp-replicated
  params on tp rank 0 only (their grads are identical across tp after finalize);
* pipeline-split params on every stage, pipeline-replicated params (tied embeddings...) on
  stage 0 only (identical after finalize's pp all-reduce);
* with the distributed optimizer each dp rank owns its shard of the reduced bucket, and the
  squared norm is summed over every mesh axis; with several distributed-optimizer instances
  every shard has one copy per instance and only instance 0's copy counts (the others have
  weight 0);
* without it every rank of a buffer's reduction group holds the same, bit-identical reduced
  bucket, so each counts it itself and the sum runs only over the other (model-parallel) axes,
  as Megatron all-reduces the norm over its model-parallel group only. For a data-parallel
  layout that is no collective at all (a scalar all-reduce across CPU processes is a
  latency-bound round trip through gloo).

The result is identical on every rank. Elements a device does not count are weighted by 0
(a multiplication, not a select), so a NaN or Inf anywhere still makes the norm non-finite:
the DDP step uses that to skip the update without a collective of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from core.parallel_state import PP_AXIS, TP_AXIS, ParallelState


def bucket_norm_weights(tp_split: jax.Array, pp_split: jax.Array, state: ParallelState) -> jax.Array:
    """Per-element 0/1 weight: whether this device counts the element in the global norm (the
    tensor- and pipeline-parallel owner rule; data parallelism is handled by the sum's axes)."""
    tp_rank0 = lax.axis_index(TP_AXIS) == 0
    pp_rank0 = lax.axis_index(PP_AXIS) == 0
    return (tp_split | tp_rank0) & (pp_split | pp_rank0)


def psum_over(x: jax.Array, axes: Sequence[str], state: ParallelState) -> jax.Array:
    """``lax.psum`` over the mesh axes of ``axes`` that have more than one device (no collective
    when there are none)."""
    axes = tuple(a for a in axes if state.mesh.shape[a] > 1)
    return lax.psum(x, axes) if axes else x


def get_grad_norm_fp32(sumsq_by_axes: Mapping[tuple[str, ...], Sequence[jax.Array]], state: ParallelState) -> jax.Array:
    """L2 norm from each device's weighted sums of squares, each group summed over its mesh axes
    (``{axes: [local sums]}``): ``sqrt(sum of psum(group, axes))``."""
    total = [psum_over(sum(jnp.asarray(s, jnp.float32) for s in sums), axes, state)
             for axes, sums in sumsq_by_axes.items()]
    return jnp.sqrt(sum(total, jnp.zeros((), jnp.float32)))


def clip_coefficient(total_norm: jax.Array, max_norm: float) -> jax.Array:
    """Megatron's ``max_norm / (total_norm + 1e-6)``, capped at 1 (no clipping below max_norm)."""
    return jnp.minimum(1.0, max_norm / (total_norm + 1.0e-6))


def clip_grad_by_total_norm(grads, max_norm: float, total_norm: jax.Array):
    """Scale every gradient by the clip coefficient (a no-op when the norm is below ``max_norm``)."""
    coef = clip_coefficient(total_norm, max_norm)
    return jax.tree.map(lambda g: g * coef.astype(g.dtype), grads)
