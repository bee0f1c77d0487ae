"""Ring attention (Megatron's ``--cp-comm-type p2p``): K/V blocks travel around the cp ring.

Called inside ``jax.shard_map`` on one context-parallel rank's local sequence. Each of the
``cp`` steps computes the local queries against the K/V block currently held while
``lax.ppermute`` passes that block on to the next rank, so the exchange can overlap the
compute and no rank ever holds more than two K/V blocks (``cp`` during a hop with the CPU
backend's all-gather rotation inside pipeline stages, below). Softmax is blockwise and online in
float32: each block product returns its normalised output and row log-sum-exp (LSE), merged
into per-chunk accumulators. The backward (``jax.custom_vjp``) saves only q, k, v, the output
and the LSE; it recomputes every block's probabilities and sends dK/dV accumulators around the
ring together with K/V, so after one more hop each rank holds the gradients of its own K/V.

K/V rotation (``kv_rotation``). ``"ppermute"`` (the default, and the only one used off the CPU
backend) sends each block to the next rank with ``lax.ppermute``; on GPU that is NCCL
send/recv between the pair (not verified on a GPU). XLA's CPU collective-permute
instead rendezvouses every device of the program (its key lists all of them), so when devices
outside the cp group run other code in between, as pipeline stages under the executor's
per-slot ``lax.cond`` do, a ring step waits for, or meets, another stage's collective-permute:
a hang or wrong K/V. ``"all_gather"`` does each hop with ``lax.all_gather`` over
``axis_name``, which rendezvouses per cp group, and keeps the previous rank's block: the same
values and schedule, but every hop moves ``cp - 1`` blocks to each rank instead of one and
holds ``cp`` blocks for the hop. :func:`kv_rotation_for` picks it on the CPU backend inside
pipeline stages only.

The causal schedule, the block products (the CPU kernel or einsums), the document mask and
attention dropout per block are ``_blocks.py``'s, shared with the all-gather variant.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from core.context_parallel._blocks import backward_steps, forward_result, forward_steps
from core.context_parallel._inputs import (
    check_segment_ids,
    default_scale,
    from_grouped,
    grouped_dropout,
    to_grouped,
)

KV_ROTATIONS = ("ppermute", "all_gather")
"""How a K/V block reaches the next ring rank: ``lax.ppermute``, or an all-gather over the cp axis
of which each rank keeps the previous rank's block (the CPU backend's fallback, see module doc)."""


def kv_rotation_for(pipelined: bool) -> str:
    """The :data:`KV_ROTATIONS` entry a ring inside a model should use: ``"all_gather"`` on the
    CPU backend when ``pipelined`` (the attention runs in a pipeline stage, whose collectives
    other stages do not execute in step, see the module doc), else ``"ppermute"``."""
    return "all_gather" if pipelined and jax.default_backend() == "cpu" else "ppermute"


def _gather_hop(x, axis_name: str, src):
    """The ``"all_gather"`` rotation: every rank gathers the cp axis's blocks and keeps axis index
    ``src``'s (the previous ring rank's), the block ``lax.ppermute`` would have sent it (a pytree of arrays)."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(lax.all_gather(a, axis_name), src, 0, keepdims=False), x)


def _topology(axis_name, isolated, kv_rotation, stride=1):
    """The ring's size, this rank and the K/V hop to the next rank: from ``axis_name`` (by
    ``kv_rotation``), or, for ``isolated = (cp, rank)``, the given ones (``rank=None``: the rank
    from ``axis_name``) and a no-op hop. ``stride > 1``: ``stride`` rings of ``size / stride``
    ranks, axis index ``j * stride + i`` being position ``j`` of ring ``i`` (``a2a+p2p``'s rings
    across its a2a groups)."""
    if isolated is None:
        index = lax.axis_index(axis_name)
        cp, rank, member = lax.axis_size(axis_name) // stride, index // stride, index % stride
        if kv_rotation == "all_gather":
            return cp, rank, partial(_gather_hop, axis_name=axis_name, src=((rank - 1) % cp) * stride + member)
        perm = [(j * stride + i, ((j + 1) % cp) * stride + i) for j in range(cp) for i in range(stride)]
        return cp, rank, partial(lax.ppermute, axis_name=axis_name, perm=perm)
    cp, rank = isolated
    return cp, lax.axis_index(axis_name) if rank is None else rank, lambda x: x


def _ring_forward(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, isolated, kv_rotation, rate, stride):
    cp, rank, hop = _topology(axis_name, isolated, kv_rotation, stride)
    compute, acc = forward_steps(q, k, v, seg, keys, rank, cp, causal, load_balanced, scale, rate)
    kv = (k, v, seg)  # the K-side segment ids travel with their K/V block (None: nothing)
    # Send the block on before computing with it: the transfer can overlap the block products.
    nxt = hop(kv) if cp > 1 else kv
    acc = compute(0, kv, acc)
    if cp > 1:
        def body(carry, step):
            kv, acc = carry
            nxt = hop(kv)
            return (nxt, compute(step, kv, acc)), None

        (kv, acc), _ = lax.scan(body, (nxt, acc), jnp.arange(1, cp - 1))
        acc = compute(cp - 1, kv, acc)  # the last block needs no onward send
    return forward_result(acc)


def _ring_backward(q, k, v, seg, keys, out, lse, do, axis_name, causal, load_balanced, scale, isolated,
                   kv_rotation, rate, stride):
    cp, rank, hop = _topology(axis_name, isolated, kv_rotation, stride)
    compute, dq = backward_steps(q, k, v, seg, keys, out, lse, do, rank, cp, causal, load_balanced, scale, rate)
    kv = (k, v, seg)
    nxt = hop(kv) if cp > 1 else kv
    dq, dk, dv = compute(0, kv, dq)
    if cp > 1:
        def body(carry, step):
            kv, dkv, dq = carry
            # The dK/dV accumulators of the block now held arrive while this step computes;
            # both sends overlap the block products.
            incoming = hop(dkv)
            nxt = hop(kv)
            dq, dk, dv = compute(step, kv, dq)
            return (nxt, (incoming[0] + dk, incoming[1] + dv), dq), None

        (kv, dkv, dq), _ = lax.scan(body, (nxt, (dk, dv), dq), jnp.arange(1, cp - 1))
        incoming = hop(dkv)
        dq, dk, dv = compute(cp - 1, kv, dq)
        # One more hop brings every accumulator home: after step cp-1 rank r holds rank r+1's.
        dk, dv = hop((incoming[0] + dk, incoming[1] + dv))
    dq = jnp.concatenate(dq, axis=3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11, 12))
def _ring(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, isolated, kv_rotation, rate, stride):
    out, _ = _ring_forward(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, isolated, kv_rotation, rate,
                           stride)
    return out.astype(q.dtype)


def _ring_fwd(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, isolated, kv_rotation, rate, stride):
    out, lse = _ring_forward(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, isolated, kv_rotation,
                             rate, stride)
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, keys, out, lse)


def _ring_bwd(axis_name, causal, load_balanced, scale, isolated, kv_rotation, rate, stride, residuals, d_out):
    q, k, v, seg, keys, out, lse = residuals
    dq, dk, dv = _ring_backward(q, k, v, seg, keys, out, lse, d_out, axis_name, causal, load_balanced, scale,
                                isolated, kv_rotation, rate, stride)
    return dq, dk, dv, None, None  # integer segment ids and PRNG keys have no cotangent


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: str = "cp", causal: bool = True,
                   load_balanced: bool = True, layout: str = "bnsd", scale: float | None = None,
                   kv_rotation: str = "ppermute", segment_ids: jax.Array | None = None,
                   dropout: tuple[jax.Array, float] | None = None, ring_stride: int = 1,
                   _isolated: tuple[int, int | None] | None = None) -> jax.Array:
    """Context-parallel attention with K/V passed around the ring of ``axis_name`` (call inside
    ``jax.shard_map``); returns the local queries' output, shaped, laid out and typed like ``q``.

    ``q``, ``k``, ``v``: this rank's local sequence in ``layout`` (``"bnsd"`` or ``"bsnd"``); ``k``/``v``
    may have fewer heads than ``q`` (grouped-query attention). With ``load_balanced`` the local
    sequence is the rank's two chunks ``r`` and ``2cp-1-r`` concatenated (the batch reordered by
    :func:`core.context_parallel.load_balance.reorder_for_cp`), else the contiguous chunk ``r``.
    ``causal`` masks by global position. Scores, softmax and accumulators are float32 whatever
    the input dtype; ``scale`` defaults to ``1 / sqrt(head_dim)``. ``kv_rotation`` (one of
    :data:`KV_ROTATIONS`) says how a block reaches the next rank: ``"ppermute"``, or
    ``"all_gather"``, the CPU backend's fallback inside pipeline stages (module doc,
    :func:`kv_rotation_for`); both give the same result. Raises ``ValueError`` for another value.
    ``segment_ids`` (``[b, local seq]`` ints, in the same order as the local q/k/v) add the
    document mask: a query attends only to keys of its own segment id (``--reset-attention-mask``);
    the K-side ids travel around the ring with their K/V block. ``dropout = (keys, rate)``
    drops attention probabilities: ``keys`` ``[b, heads]`` typed PRNG keys, one per sample and
    (global) query head, drawn per global (query, key) token index
    (:func:`~core.context_parallel.dropout.attention_dropout_mask`), so every layout agrees.
    ``ring_stride`` ``A > 1`` runs ``A`` rings of ``size / A`` ranks over ``axis_name``, axis index
    ``j A + i`` being position ``j`` of ring ``i`` (``a2a+p2p``, ``a2a_attention.py``); the local
    sequence is then that ring position's chunks.

    ``_isolated = (cp, rank)`` is a benchmark hook (``bench/context_parallel.py``), not attention:
    it runs rank ``rank``'s schedule of a ring of ``cp`` with every K/V hop a no-op, so each step
    computes with the local K/V: the same block products in the same shapes, no communication,
    and no ``axis_name`` needed. ``(cp, None)`` inside ``shard_map``: every rank of ``axis_name``
    runs its own schedule, none communicates. The result's values are meaningless.
    """
    if kv_rotation not in KV_ROTATIONS:
        raise ValueError(f"kv_rotation must be one of {KV_ROTATIONS}, got {kv_rotation!r}")
    qg, k, v = to_grouped(q, k, v, layout, load_balanced)
    seg = None if segment_ids is None else check_segment_ids(segment_ids, qg)
    keys, rate = grouped_dropout(dropout, qg)
    out = _ring(qg, k, v, seg, keys, axis_name, bool(causal), bool(load_balanced), default_scale(q, scale), _isolated,
                kv_rotation, rate, int(ring_stride))
    return from_grouped(out, layout)
