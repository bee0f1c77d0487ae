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
