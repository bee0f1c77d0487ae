"""Global gradient norm across every rank, and clipping by it (Megatron's ``clip_grads``).

Every gradient element must be counted exactly once in the global norm, although copies of
it live on several devices. Each element is counted on one owner:

* tensor-parallel-split params on every tp rank (each holds a different slice), tp-replicated
  params on tp rank 0 only (their grads are identical across tp after finalize);
* pipeline-split params on every stage, pipeline-replicated params (tied embeddings...) on
  stage 0 only (identical after finalize's pp all-reduce);
* with the distributed optimizer each dp rank owns its shard; without it, dp rank 0 (of the
  buffer's reduction group) owns the whole, replicated bucket.

Then one ``psum`` over all mesh axes gives the squared norm, identical on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from core.parallel_state import PP_AXIS, TP_AXIS, ParallelState


def bucket_norm_weights(
    tp_split: jax.Array, pp_split: jax.Array, state: ParallelState, dp_owner: jax.Array | bool = True
) -> jax.Array:
    """Per-element 0/1 weight: whether this device counts the element in the global norm."""
    tp_rank0 = lax.axis_index(TP_AXIS) == 0
    pp_rank0 = lax.axis_index(PP_AXIS) == 0
    return (tp_split | tp_rank0) & (pp_split | pp_rank0) & dp_owner


def get_grad_norm_fp32(local_sumsq: Sequence[jax.Array], state: ParallelState) -> jax.Array:
    """L2 norm from each device's weighted sum of squares: sqrt(psum over every mesh axis)."""
    total = sum(jnp.asarray(s, jnp.float32) for s in local_sumsq)
    return jnp.sqrt(lax.psum(total, tuple(state.mesh.axis_names)))


def clip_coefficient(total_norm: jax.Array, max_norm: float) -> jax.Array:
    """Megatron's ``max_norm / (total_norm + 1e-6)``, capped at 1 (no clipping below max_norm)."""
    return jnp.minimum(1.0, max_norm / (total_norm + 1.0e-6))


def clip_grad_by_total_norm(grads, max_norm: float, total_norm: jax.Array):
    """Scale every gradient by the clip coefficient (a no-op when the norm is below ``max_norm``)."""
    coef = clip_coefficient(total_norm, max_norm)
    return jax.tree.map(lambda g: g * coef.astype(g.dtype), grads)
