"""Megatron's forward-backward API: ``get_forward_backward_func`` and the schedules it returns.

Contract (Megatron's, adapted to functional JAX):

* ``forward_step_func(data, model) -> (output, loss_func)``; ``data`` is one microbatch taken
  from ``data_iterator`` and ``model`` a callable ``model(x) -> y``. In a pipeline the model
  object is the *stage*: on stage 0 it consumes ``x``, on later stages it ignores ``x`` and
  consumes the activation received from the previous stage (Megatron's ``set_input_tensor``).
* ``loss_func(output) -> (loss, reduced_loss_dict)`` or ``(loss_sum, num_tokens, dict)``.
* ``model`` is ``(stage_fn, params)`` with ``stage_fn(params, x) -> y``; gradients are taken
  with respect to ``params`` (the stage's own parameters in a pipeline).
* Returns ``(losses_reduced, grads, num_tokens)``: Megatron's list of one reduced-loss dict per
  microbatch (valid on the last stage; zeros on other stages in SPMD), the parameter grads
  (``None`` when ``forward_only``) and the summed token count (``None`` without per-token loss).

Loss scaling, applied exactly once (see ``core/distributed/finalize_model_grads.py``): with
``(loss, dict)`` each microbatch loss is divided by ``num_microbatches`` here; with
``(loss_sum, num_tokens, dict)`` nothing is divided here and ``finalize_model_grads`` divides by
the global token count. Data-parallel averaging is DDP's job.

The pipelined schedules must be called inside ``shard_map`` over the ``"pp"`` axis; the
``data_iterator`` is read at trace time (``num_microbatches`` items, stacked), so it should yield
the shard_map-local microbatch slices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from core import parallel_state as ps


def _split_loss(result: tuple, num_microbatches: int) -> tuple[jax.Array, jax.Array | None, dict]:
    """Normalise ``loss_func``'s result to (scaled loss, num_tokens or None, dict)."""
    if len(result) == 3:
        loss, num_tokens, d = result
        return loss, jnp.asarray(num_tokens, jnp.float32), d
    if len(result) == 2:
        loss, d = result
        return loss / num_microbatches, None, d
    raise ValueError(f"loss_func must return (loss, dict) or (loss, num_tokens, dict), got {len(result)} items")


def _take(data_iterator: Iterator, num_microbatches: int) -> Any:
    items = [next(data_iterator) for _ in range(num_microbatches)]
    return jax.tree.map(lambda *a: jnp.stack(a), *items)


def _unstack(stacked: dict, n: int) -> list[dict]:
    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)]


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator: Iterator, model: tuple,
                                   num_microbatches: int, seq_length: int | None = None,
                                   micro_batch_size: int | None = None, forward_only: bool = False):
    """All microbatches through the whole model on this rank; grads accumulated over microbatches."""
    del seq_length, micro_batch_size  # shapes come from the data in JAX
    stage_fn, params = model
    data = _take(data_iterator, num_microbatches)

    def one(p, d):
        out, loss_func = forward_step_func(d, lambda x: stage_fn(p, x))
        loss, nt, rd = _split_loss(loss_func(out), num_microbatches)
        return loss, (nt if nt is not None else jnp.zeros(()), rd)

    def total(p):
        losses, (nts, rds) = jax.vmap(lambda d: one(p, d))(data)
        return jnp.sum(losses), (nts, rds)

    if forward_only:
        _, (nts, rds) = total(params)
        grads = None
    else:
        (_, (nts, rds)), grads = jax.value_and_grad(total, has_aux=True)(params)
    d0 = jax.tree.map(lambda a: a[0], data)
    per_token = _returns_num_tokens(forward_step_func, d0, stage_fn, params)  # traced once; dead code for XLA
    return _unstack(rds, num_microbatches), grads, (jnp.sum(nts) if per_token else None)


def _returns_num_tokens(forward_step_func, d, stage_fn, params) -> bool:
    out, loss_func = forward_step_func(d, lambda x: stage_fn(params, x))
    return len(loss_func(out)) == 3


def forward_backward_pipelining_without_interleaving(*, forward_step_func: Callable, data_iterator: Iterator,
                                                     model: tuple, num_microbatches: int,
                                                     seq_length: int | None = None,
                                                     micro_batch_size: int | None = None,
                                                     forward_only: bool = False, axis_name: str = "pp"):
    """1F1B over ``axis_name`` (see :mod:`core.pipeline_parallel.one_f_one_b` for the slot layout).

    Call inside ``shard_map``; ``model = (stage_fn, stage_params)`` with homogeneous stages
    (``y.shape == x.shape``) and the stage input taken from ``forward_step_func``'s call of the model.
    """
    del seq_length, micro_batch_size
    stage_fn, params = model
    data = _take(data_iterator, num_microbatches)
    num_stages = lax.axis_size(axis_name)
    stage = lax.axis_index(axis_name)
    m = num_microbatches
    is_last = stage == num_stages - 1
    stash_size = 2 * num_stages - 1
    num_slots = m + 2 * num_stages - 2
    fwd_perm = [(i, i + 1) for i in range(num_stages - 1)]
    bwd_perm = [(i + 1, i) for i in range(num_stages - 1)]

    def stage_model(p, received):
        # Megatron's set_input_tensor: stage 0 reads the data, later stages the received activation.
        return lambda x: stage_fn(p, jnp.where(stage == 0, x, received))

    def run(p, d, received):
        out, loss_func = forward_step_func(d, stage_model(p, received))
        return out, _split_loss(loss_func(out), m)

    d0 = jax.tree.map(lambda a: a[0], data)
    out_shape, (_, nt0, _) = jax.eval_shape(lambda: run(params, d0, jnp.zeros(())))
    per_token = nt0 is not None
    zeros_act = jnp.zeros(out_shape.shape, out_shape.dtype)

    def slot(carry, t):
        recv_f, recv_b, stash, grads, ntok = carry
        mf = t - stage
        f_valid = (mf >= 0) & (mf < m)
        mf_c = jnp.clip(mf, 0, m - 1)
        y, _ = run(params, jax.tree.map(lambda a: a[mf_c], data), recv_f)
        idx = mf_c % stash_size
        stash = stash.at[idx].set(jnp.where(f_valid, recv_f, stash[idx]))
        mb = t - (2 * num_stages - 2 - stage)
        b_valid = (mb >= 0) & (mb < m)
        mb_c = jnp.clip(mb, 0, m - 1)
        d_b = jax.tree.map(lambda a: a[mb_c], data)
        received = stash[mb_c % stash_size]
        if forward_only:
            _, (loss, nt, rd) = run(params, d_b, received)
            gx = zeros_act
        else:
            (_, (loss, nt, rd)), vjp = _vjp_with_aux(run, params, d_b, received)
            cot_y = jnp.where(is_last, jnp.zeros_like(recv_b), recv_b)
            gp, gx = vjp((cot_y, jnp.where(is_last, 1.0, 0.0).astype(loss.dtype)))
            scale = b_valid.astype(loss.dtype)
            grads = jax.tree.map(lambda a, g: a + scale * g, grads, gp)
            gx = gx * scale
        last_valid = b_valid & is_last
        if per_token:
            ntok = ntok + jnp.where(last_valid, nt, 0.0)
        rd = jax.tree.map(lambda a: jnp.where(last_valid, a, jnp.zeros_like(a)), rd)
        recv_f = lax.ppermute(y, axis_name, fwd_perm) if fwd_perm else y
        recv_b = lax.ppermute(gx, axis_name, bwd_perm) if bwd_perm else gx
        return (recv_f, recv_b, stash, grads, ntok), rd

    stash = jnp.zeros((stash_size,) + zeros_act.shape, zeros_act.dtype)
    grads = jax.tree.map(jnp.zeros_like, params)
    carry = (zeros_act, zeros_act, stash, grads, jnp.zeros((), jnp.float32))
    (_, _, _, grads, ntok), rds = lax.scan(slot, carry, jnp.arange(num_slots))
    # On the last stage microbatch i's backward runs in slot i + pp - 1.
    rds = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, num_stages - 1, m), rds)
    return _unstack(rds, m), (None if forward_only else grads), (ntok if per_token else None)


def _vjp_with_aux(run, params, d_b, received):
    """vjp of ``(out, loss)`` w.r.t. (params, received), carrying num_tokens and the dict along."""
    def f(p, r):
        out, (loss, nt, rd) = run(p, d_b, r)
        return (out, loss), (nt, rd)
    (out, loss), vjp, (nt, rd) = jax.vjp(f, params, received, has_aux=True)
    return (out, (loss, nt, rd)), vjp


def forward_backward_pipelining_with_interleaving(**kwargs):
    """Interleaved 1F1B with Megatron's contract: not implemented.

    The functional executor ``one_f_one_b.forward_backward_interleaved(stage_fn, loss_fn, ...)``
    runs the interleaved model layout (grads equal the non-pipelined model) and
    ``schedule_table.get_schedule_table`` gives Megatron's order; this wrapper is not written.
    """
    raise NotImplementedError(
        "forward_backward_pipelining_with_interleaving (Megatron contract) is not implemented; use "
        "core.pipeline_parallel.one_f_one_b.forward_backward_interleaved(stage_fn, loss_fn, params, x, targets, "
        "num_model_chunks=vpp)")


def get_forward_backward_func(state: ps.ParallelState | None = None) -> Callable:
    """Pick the schedule by the pipeline and virtual-pipeline sizes, as Megatron does."""
    state = state if state is not None else ps.get_parallel_state()
    pp = state.pipeline_model_parallel_size
    vpp = getattr(state, "virtual_pipeline_model_parallel_size", None)
    if pp > 1:
        if vpp is not None and vpp > 1:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining
