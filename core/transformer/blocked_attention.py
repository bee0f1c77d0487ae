"""Blocked causal attention in XLA ops: flash-style, a (batch x head) chunk at a time.

Plain attention materialises ``[b, heads, s, s]`` scores, probabilities and their gradients;
on CPU writing those buffers costs more than the matmuls (a fresh buffer of tens of MB is
page-faulted in, and the ``Q K^T`` batched matmul writing it runs at a fraction of its speed with
an output that stays in cache; ``bench/results/2026-11-cpu-tuning.md``). Here ``lax.map`` walks
chunks of ``chunk`` (batch x head) rows, so every intermediate is ``[chunk, block, s]``, and a
``custom_vjp`` keeps only the output and the row log-sum-exp: the backward recomputes
``P = exp(S - lse)`` per chunk (flash attention's backward, ``dS = P * (dP - rowsum(dO * O))``).
Query block ``i`` only meets key blocks ``0..i``, about half the FLOPs of the full score matrix.
Scores and their products accumulate in float32 whatever the input dtype. Plain XLA ops, sized
for CPU caches: it is the CPU path where the C++ kernel of ``core/fusions/fused_attention.py``
does not apply (the dispatcher is ``core/transformer/dot_product_attention.py``); on GPUs cuDNN
or XLA's attention runs.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32


def blocked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_size: int = 64,
                             chunk: int = 2, segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal attention on ``[b, heads, s, d]`` with softmax in float32; returns ``[b, heads, s, d]``.

    ``segment_ids`` (``[b, s]`` ints, optional) make the mask document-causal: a query attends
    only to earlier-or-same positions with its own segment id (Megatron's
    ``--reset-attention-mask``). The diagonal is always allowed, so no row is fully masked.

    ``block_size`` is the query/key block (the whole sequence when it does not divide ``s``),
    ``chunk`` the (batch x head) rows per step (the largest divisor of ``b * heads`` up to it).
    Small chunks keep each step's scores in cache: the default of 2 rows is the fastest of the
    small sizes on one core, by a small margin (``bench/results/2026-11-cpu-tuning.md``).
    """
    b, n, s, d = q.shape
    rows = b * n
    c = max(x for x in range(1, min(chunk, rows) + 1) if rows % x == 0)
    bs = block_size if s % block_size == 0 and s > block_size else s
    split = lambda x: x.reshape(rows // c, c, s, d)
    if segment_ids is None:
        return _chunked_attention(split(q), split(k), split(v), bs).reshape(b, n, s, d)
    # One segment row per (batch, head) row, chunked like q (row index b * heads + head).
    seg = jnp.repeat(segment_ids.astype(jnp.int32), n, axis=0).reshape(rows // c, c, s)
    return _chunked_segment_attention(split(q), split(k), split(v), seg, bs).reshape(b, n, s, d)


def _blocks(s: int, bs: int, seg: jax.Array | None = None):
    """(query slice, key end, mask) for each query block: causal, and within a segment when
    ``seg`` (``[c, s]``) is given (mask ``[c, block, end]`` then, else ``[block, end]``)."""
    for i in range(s // bs):
        end = (i + 1) * bs
        allowed = jnp.arange(i * bs, end)[:, None] >= jnp.arange(end)[None, :]
        if seg is not None:
            allowed = allowed & (seg[:, i * bs:end, None] == seg[:, None, :end])
        yield slice(i * bs, end), end, allowed


def _scores(q: jax.Array, k: jax.Array, rows: slice, end: int) -> jax.Array:
    """Scaled float32 scores ``[c, block, end]`` of query rows ``rows`` against keys ``0..end``."""
    scale = 1.0 / float(q.shape[-1]) ** 0.5
    return jnp.einsum("cqd,ckd->cqk", q[:, rows], k[:, :end], preferred_element_type=_F32) * scale


def _chunk_forward(q: jax.Array, k: jax.Array, v: jax.Array, bs: int,
                   seg: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """One chunk ``[c, s, d]``: the output and the float32 row log-sum-exp ``[c, s]``."""
    outs, lses = [], []
    for rows, end, allowed in _blocks(q.shape[1], bs, seg):
        scores = jnp.where(allowed, _scores(q, k, rows, end), -jnp.inf)
        m = jnp.max(scores, axis=-1, keepdims=True)
        p = jnp.exp(scores - m)
        total = jnp.sum(p, axis=-1, keepdims=True)
        out = jnp.einsum("cqk,ckd->cqd", p.astype(v.dtype), v[:, :end], preferred_element_type=_F32) / total
        outs.append(out.astype(q.dtype))
        lses.append((m + jnp.log(total))[..., 0])
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def _chunk_backward(q, k, v, out, lse, d_out, bs: int, seg=None):
    """Gradients of one chunk from its saved output and log-sum-exp (probabilities recomputed)."""
    scale = 1.0 / float(q.shape[-1]) ** 0.5
    delta = jnp.sum(d_out.astype(_F32) * out.astype(_F32), axis=-1)  # rowsum(dO * O)
    dqs, dk, dv = [], jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32)
    for rows, end, allowed in _blocks(q.shape[1], bs, seg):
        p = jnp.where(allowed, jnp.exp(_scores(q, k, rows, end) - lse[:, rows, None]), 0.0)
        do = d_out[:, rows]
        dv = dv.at[:, :end].add(jnp.einsum("cqk,cqd->ckd", p.astype(do.dtype), do, preferred_element_type=_F32))
        dp = jnp.einsum("cqd,ckd->cqk", do, v[:, :end], preferred_element_type=_F32)
        ds = (p * (dp - delta[:, rows, None]) * scale).astype(q.dtype)
        dqs.append(jnp.einsum("cqk,ckd->cqd", ds, k[:, :end], preferred_element_type=_F32))
        dk = dk.at[:, :end].add(jnp.einsum("cqk,cqd->ckd", ds, q[:, rows], preferred_element_type=_F32))
    return jnp.concatenate(dqs, axis=1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, bs: int) -> jax.Array:
    """Attention over ``[chunks, c, s, d]``, one chunk per ``lax.map`` step."""
    return _chunked_forward(q, k, v, bs)[0]


def _chunked_forward(q, k, v, bs):
    return lax.map(lambda xs: _chunk_forward(*xs, bs), (q, k, v))


def _chunked_attention_fwd(q, k, v, bs):
    out, lse = _chunked_forward(q, k, v, bs)
    return out, (q, k, v, out, lse)


def _chunked_attention_bwd(bs, residuals, d_out):
    return lax.map(lambda xs: _chunk_backward(*xs, bs), (*residuals, d_out))


_chunked_attention.defvjp(_chunked_attention_fwd, _chunked_attention_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, bs: int) -> jax.Array:
    """:func:`_chunked_attention` with the document-causal mask of segment ids ``[chunks, c, s]``
    (a separate function so the plain causal path keeps its exact program)."""
    return _chunked_segment_forward(q, k, v, seg, bs)[0]


def _chunked_segment_forward(q, k, v, seg, bs):
    return lax.map(lambda xs: _chunk_forward(*xs[:3], bs, xs[3]), (q, k, v, seg))


def _chunked_segment_attention_fwd(q, k, v, seg, bs):
    out, lse = _chunked_segment_forward(q, k, v, seg, bs)
    return out, (q, k, v, out, lse, seg)


def _chunked_segment_attention_bwd(bs, residuals, d_out):
    *saved, seg = residuals
    grads = lax.map(lambda xs: _chunk_backward(*xs[:6], bs, xs[6]), (*saved, d_out, seg))
    return (*grads, None)  # integer segment ids: no cotangent


_chunked_segment_attention.defvjp(_chunked_segment_attention_fwd, _chunked_segment_attention_bwd)
