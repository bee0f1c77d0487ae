"""All-gather context-parallel attention (Megatron's ``--cp-comm-type all_gather``, MaxText's default).

Each rank keeps its local queries and all-gathers K/V over the cp axis once, then runs the ring's
blockwise schedule (``ring_attention.py``) over the gathered blocks without any further exchange:
at step ``t`` rank ``r`` computes against source rank ``(r - t) mod cp``'s block, read from the
gathered K/V instead of received from a neighbour. So it has the ring's properties but for the
communication: the same block products (the CPU kernel where it applies, einsums elsewhere),
blocks above the causal diagonal skipped, float32 online softmax, the document mask and
attention dropout per block, and a custom backward that saves only q, k, v, the output and the
LSE (memory linear in the sequence, no ``[local, global]`` score matrix). The backward gathers
K/V again, accumulates each source block's dK/dV into a ``[cp, ...]`` float32 buffer and
reduce-scatters it over cp (``lax.psum_scatter``), which sums every rank's share of a block's
gradients onto its owner. One collective per tensor and direction; unlike the ring's hops it
cannot overlap the compute, and every rank holds the full K/V and its gradient buffer.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from core.context_parallel._blocks import F32, backward_steps, forward_result, forward_steps, source_rank
from core.context_parallel._inputs import (
    check_segment_ids,
    default_scale,
    from_grouped,
    grouped_dropout,
    to_grouped,
)


def _gather(x, axis_name: str):
    """``x`` of every cp rank stacked on a new leading axis in rank order (None stays None)."""
    return jax.tree.map(lambda a: lax.all_gather(a, axis_name), x)


def _held(gathered, rank, step, cp):
    """The (k, v, segment ids) block of the source rank of ``step`` (the ring's schedule)."""
    src = source_rank(rank, step, cp)
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, src, 0, keepdims=False), gathered)


def _gathered_forward(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, rate):
    cp, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
    compute, acc = forward_steps(q, k, v, seg, keys, rank, cp, causal, load_balanced, scale, rate)
    acc = compute(0, (k, v, seg), acc)  # the own block: step 0, the diagonal case
    if cp > 1:
        gathered = _gather((k, v, seg), axis_name)
        acc = lax.fori_loop(1, cp, lambda step, acc: compute(step, _held(gathered, rank, step, cp), acc), acc)
    return forward_result(acc)


def _gathered_backward(q, k, v, seg, keys, out, lse, do, axis_name, causal, load_balanced, scale, rate):
    cp, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
    compute, dq = backward_steps(q, k, v, seg, keys, out, lse, do, rank, cp, causal, load_balanced, scale, rate)
    dq, dk, dv = compute(0, (k, v, seg), dq)
    if cp > 1:
        gathered = _gather((k, v, seg), axis_name)

        def add_at(buf, step, x):  # buf[source of step] += x
            src = source_rank(rank, step, cp)
            return lax.dynamic_update_index_in_dim(buf, lax.dynamic_index_in_dim(buf, src, 0, keepdims=False) + x,
                                                   src, 0)

        def body(step, carry):
            dq, dk_all, dv_all = carry
            dq, g_k, g_v = compute(step, _held(gathered, rank, step, cp), dq)
            return dq, add_at(dk_all, step, g_k), add_at(dv_all, step, g_v)

        # Step 0's block is this rank's own (source = rank).
        dk_all = add_at(jnp.zeros((cp, *k.shape), F32), 0, dk)
        dv_all = add_at(jnp.zeros((cp, *v.shape), F32), 0, dv)
        dq, dk_all, dv_all = lax.fori_loop(1, cp, body, (dq, dk_all, dv_all))
        # Row i of every rank's buffer holds its share of rank i's block gradients: sum onto rank i.
        dk, dv = (lax.psum_scatter(x, axis_name, scatter_dimension=0) for x in (dk_all, dv_all))
    return jnp.concatenate(dq, axis=3).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _gathered(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, rate):
    return _gathered_forward(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, rate)[0].astype(q.dtype)


def _gathered_fwd(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, rate):
    out, lse = _gathered_forward(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, rate)
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, keys, out, lse)


def _gathered_bwd(axis_name, causal, load_balanced, scale, rate, residuals, d_out):
    q, k, v, seg, keys, out, lse = residuals
    dq, dk, dv = _gathered_backward(q, k, v, seg, keys, out, lse, d_out, axis_name, causal, load_balanced, scale,
                                    rate)
    return dq, dk, dv, None, None  # integer segment ids and PRNG keys have no cotangent


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def all_gather_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: str = "cp", causal: bool = True,
                         load_balanced: bool = True, layout: str = "bnsd", scale: float | None = None,
                         segment_ids: jax.Array | None = None,
                         dropout: tuple[jax.Array, float] | None = None) -> jax.Array:
    """Context-parallel attention with K/V all-gathered over ``axis_name`` (call inside
    ``jax.shard_map``); returns the local queries' output, shaped, laid out and typed like ``q``.

    Arguments as :func:`core.context_parallel.ring_attention.ring_attention`: local q/k/v in
    ``layout``, K/V heads may divide the query heads (GQA), ``load_balanced`` says the local
    sequence is chunks ``r`` and ``2cp-1-r``, ``segment_ids`` (``[b, local seq]``, optional) the
    document mask, ``dropout = (keys [b, heads], rate)`` the attention dropout. float32 scores,
    softmax and accumulators; ``scale`` defaults to ``1 / sqrt(head_dim)``.
    """
    qg, k, v = to_grouped(q, k, v, layout, load_balanced)
    seg = None if segment_ids is None else check_segment_ids(segment_ids, qg)
    keys, rate = grouped_dropout(dropout, qg)
    out = _gathered(qg, k, v, seg, keys, axis_name, bool(causal), bool(load_balanced), default_scale(q, scale), rate)
    return from_grouped(out, layout)
