"""1F1B pipeline schedule as one SPMD program inside ``jax.shard_map`` (forward and backward).

Every pipeline stage runs the same ``lax.scan`` over ``T = M + 2 * pp - 2`` time slots. In slot
``t`` stage ``s`` does

* one forward of microbatch ``t - s`` (if in ``[0, M)``), stashing its stage input in a ring
  buffer of ``2 * pp - 1`` entries, and sends the output to stage ``s + 1`` (``ppermute``);
* one backward of microbatch ``t - (2 * pp - 2 - s)`` (if in ``[0, M)``): the stage forward is
  recomputed from the stashed input inside ``jax.vjp`` and the input gradient is sent to stage
  ``s - 1`` (``ppermute``). On the last stage the cotangent is the loss's own gradient.

Warm-up (forward only) lasts ``2 * (pp - 1 - s)`` slots on stage ``s``, then every slot is one
forward plus one backward, then a cool-down of backwards. A microbatch's stage input lives at most
``2 * pp - 2`` slots, so activation memory is ``O(pp)`` stage inputs, independent of ``M`` (GPipe's
autodiff keeps ``O(M)``). Idle halves of a slot compute on dummy data and are masked out, so the
step costs ``T`` slots of (forward + recompute + backward); the bubble is ``(2 pp - 2) / (M + 2 pp - 2)``.

Note vs Megatron: Megatron's warm-up is ``pp - s - 1`` forwards because its time unit is one
forward *or* one backward; here a slot holds both, so the warm-up in slots is twice as long and
up to ``2 * (pp - 1 - s) + 1`` inputs are in flight instead of ``pp - s``; both are ``O(pp)``.

Loss scaling convention (shared with ``finalize_model_grads``): each microbatch loss is divided
by ``num_microbatches`` here; data-parallel averaging (divide by dp) is DDP's job, not the schedule's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def forward_backward_1f1b(stage_fn: Callable[[Any, jax.Array], jax.Array],
                          loss_fn: Callable[[jax.Array, Any], jax.Array], params: Any, microbatches: jax.Array,
                          targets: Any, *, axis_name: str = "pp") -> tuple[jax.Array, Any]:
    """Run the 1F1B schedule over ``axis_name``; call inside ``shard_map``.

    Args:
      stage_fn: ``stage_fn(stage_params, x) -> y`` with ``y.shape == x.shape`` (homogeneous stages).
      loss_fn: ``loss_fn(y, target) -> scalar`` applied on the last stage per microbatch.
      params: this stage's parameters.
      microbatches: ``[M, ...]`` inputs (only stage 0 reads them).
      targets: pytree of ``[M, ...]`` targets (only the last stage reads them).
    Returns:
      ``(loss, grads)``: the mean microbatch loss (on the last stage, 0 elsewhere) and this
      stage's parameter gradients of that mean loss.
    """
    num_stages = lax.axis_size(axis_name)
    stage = lax.axis_index(axis_name)
    m = microbatches.shape[0]
    if num_stages < 1 or m < 1:
        raise ValueError(f"need >= 1 stage and >= 1 microbatch, got pp={num_stages}, M={m}")
    stash_size = 2 * num_stages - 1
    num_slots = m + 2 * num_stages - 2
    is_last = stage == num_stages - 1
    fwd_perm = [(i, i + 1) for i in range(num_stages - 1)]
    bwd_perm = [(i + 1, i) for i in range(num_stages - 1)]
    x0 = jnp.zeros_like(microbatches[0])

    def stage_and_loss(p, x, target):
        y = stage_fn(p, x)
        return y, loss_fn(y, target) / m

    def slot(carry, t):
        recv_f, recv_b, stash, grads, loss = carry
        # Forward of microbatch t - stage.
        mf = t - stage
        f_valid = (mf >= 0) & (mf < m)
        mf_c = jnp.clip(mf, 0, m - 1)
        x = jnp.where(stage == 0, microbatches[mf_c], recv_f)
        y = stage_fn(params, x)
        slot_idx = mf_c % stash_size
        stash = stash.at[slot_idx].set(jnp.where(f_valid, x, stash[slot_idx]))
        # Backward of microbatch t - (2 pp - 2 - stage); on the last stage it is the one just forwarded.
        mb = t - (2 * num_stages - 2 - stage)
        b_valid = (mb >= 0) & (mb < m)
        mb_c = jnp.clip(mb, 0, m - 1)
        xb = stash[mb_c % stash_size]
        target = jax.tree.map(lambda a: a[mb_c], targets)
        (_, mb_loss), vjp = jax.vjp(lambda p, x: stage_and_loss(p, x, target), params, xb)
        # Last stage: d(loss)/d(loss) = 1 and no downstream cotangent; others: the received gradient.
        cot_y = jnp.where(is_last, jnp.zeros_like(recv_b), recv_b)
        gp, gx = vjp((cot_y, jnp.where(is_last, 1.0, 0.0).astype(mb_loss.dtype)))
        scale = b_valid.astype(mb_loss.dtype)
        grads = jax.tree.map(lambda a, g: a + scale * g, grads, gp)
        loss = loss + jnp.where(b_valid & is_last, mb_loss, 0.0)
        recv_f = lax.ppermute(y, axis_name, fwd_perm) if fwd_perm else y
        recv_b = lax.ppermute(gx * scale, axis_name, bwd_perm) if bwd_perm else gx
        return (recv_f, recv_b, stash, grads, loss), None

    stash = jnp.zeros((stash_size,) + x0.shape, x0.dtype)
    grads = jax.tree.map(jnp.zeros_like, params)
    carry = (x0, x0, stash, grads, jnp.zeros((), jnp.float32))
    (_, _, _, grads, loss), _ = lax.scan(slot, carry, jnp.arange(num_slots))
    return loss, grads


def forward_backward_interleaved(stage_fn: Callable[[Any, jax.Array], jax.Array],
                                 loss_fn: Callable[[jax.Array, Any], jax.Array], params: Any, microbatches: jax.Array,
                                 targets: Any, *, num_model_chunks: int, axis_name: str = "pp"
                                 ) -> tuple[jax.Array, Any]:
    """Interleaved model layout (chunk ``c`` of rank ``r`` is virtual stage ``c * pp + r``); call inside ``shard_map``.

    ``params`` has a leading ``[num_model_chunks]`` dim (this rank's chunks). Runs the same slot
    grid as :func:`forward_backward_1f1b` over ``V = pp * vpp`` virtual stages: every slot runs
    each local chunk once forward and once backward (masked when idle); activations move with a
    ring ``ppermute`` (rank ``pp-1`` chunk ``c`` -> rank 0 chunk ``c+1``, gradients the reverse).
    Gradients equal the non-pipelined model, but this grid does NOT give Megatron's interleaved
    bubble ``(p-1)/(v m)``: its bubble is ``(2V-2)/(m+2V-2)``. Megatron's table-ordered executor
    (``schedule_table.get_schedule_table``) is not implemented.
    """
    num_stages = lax.axis_size(axis_name)
    rank = lax.axis_index(axis_name)
    vpp = num_model_chunks
    if vpp > 1 and num_stages < 2:
        raise ValueError(f"interleaving ({vpp} model chunks) needs pipeline_model_parallel_size >= 2, got {num_stages}")
    m = microbatches.shape[0]
    v_total = num_stages * vpp
    stash_size = 2 * v_total - 1
    num_slots = m + 2 * v_total - 2
    chunks = jnp.arange(vpp)
    vstage = chunks * num_stages + rank  # [vpp] virtual stage of each local chunk
    is_last = vstage == v_total - 1
    ring_f = [(i, (i + 1) % num_stages) for i in range(num_stages)]
    ring_b = [(i, (i - 1) % num_stages) for i in range(num_stages)]
    x0 = jnp.zeros((vpp,) + microbatches.shape[1:], microbatches.dtype)

    def chunk_loss(p, x, target):
        y = stage_fn(p, x)
        return y, loss_fn(y, target) / m

    def slot(carry, t):
        recv_f, recv_b, stash, grads, loss = carry
        mf = t - vstage
        f_valid = (mf >= 0) & (mf < m)
        mf_c = jnp.clip(mf, 0, m - 1)
        x = jnp.where(_bcast(vstage == 0, x0), microbatches[mf_c], recv_f)
        y = jax.vmap(stage_fn)(params, x)
        idx = mf_c % stash_size
        old = stash[chunks, idx]
        stash = stash.at[chunks, idx].set(jnp.where(_bcast(f_valid, x), x, old))
        mb = t - (2 * v_total - 2 - vstage)
        b_valid = (mb >= 0) & (mb < m)
        mb_c = jnp.clip(mb, 0, m - 1)
        xb = stash[chunks, mb_c % stash_size]
        target = jax.tree.map(lambda a: a[mb_c], targets)

        def one_chunk(p, xb, target, g_in, last):
            (_, loss_c), vjp = jax.vjp(lambda p, x: chunk_loss(p, x, target), p, xb)
            gp, gx = vjp((jnp.where(last, jnp.zeros_like(g_in), g_in), jnp.where(last, 1.0, 0.0).astype(loss_c.dtype)))
            return loss_c, gp, gx

        ls, gp, gx = jax.vmap(one_chunk)(params, xb, target, recv_b, is_last)
        scale = b_valid.astype(ls.dtype)
        grads = jax.tree.map(lambda a, g: a + _bcast(scale, g) * g, grads, gp)
        loss = loss + jnp.sum(jnp.where(b_valid & is_last, ls, 0.0))
        gx = gx * _bcast(scale, gx)
        # Forward ring: rank 0 receives rank pp-1's chunk c output as its chunk c+1 input.
        got_f = lax.ppermute(y, axis_name, ring_f)
        recv_f = jnp.where(rank == 0, jnp.roll(got_f, 1, axis=0), got_f)
        # Backward ring: rank pp-1 receives rank 0's chunk c input grad as its chunk c-1 output grad.
        got_b = lax.ppermute(gx, axis_name, ring_b)
        recv_b = jnp.where(rank == num_stages - 1, jnp.roll(got_b, -1, axis=0), got_b)
        return (recv_f, recv_b, stash, grads, loss), None

    stash = jnp.zeros((vpp, stash_size) + x0.shape[1:], x0.dtype)
    grads = jax.tree.map(jnp.zeros_like, params)
    carry = (x0, x0, stash, grads, jnp.zeros((), jnp.float32))
    (_, _, _, grads, loss), _ = lax.scan(slot, carry, jnp.arange(num_slots))
    return loss, grads


def _bcast(mask: jax.Array, like: jax.Array) -> jax.Array:
    """Reshape a ``[vpp]`` mask to broadcast against a ``[vpp, ...]`` array."""
    return mask.reshape(mask.shape + (1,) * (like.ndim - mask.ndim))
