"""Shared input handling of the context-parallel attention functions: layout, GQA grouping, checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LAYOUTS = ("bnsd", "bsnd")
"""q/k/v layouts: ``[batch, heads, seq, head_dim]`` and ``[batch, seq, heads, head_dim]``."""


def to_grouped(q: jax.Array, k: jax.Array, v: jax.Array, layout: str, load_balanced: bool
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Check local q/k/v and bring them to ``q: [b, kv_heads, group, s, d]``, ``k, v: [b, kv_heads, s, d]``.

    Grouped-query attention stays grouped (query head ``i`` reads K/V head ``i // group``) rather
    than repeating K/V to the query heads, so the ring moves and the gather collects only the
    K/V heads that exist.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"q, k, v must be 4-d with k.shape == v.shape, got {q.shape}, {k.shape}, {v.shape}")
    if layout == "bsnd":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    b, heads, s, d = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(f"k/v {k.shape} do not match q {q.shape} in batch, local sequence or head dim "
                         f"(layout {layout!r}; context-parallel self-attention needs equal local lengths)")
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of K/V heads ({kv_heads})")
    if load_balanced and s % 2:
        raise ValueError(f"load-balanced context parallelism needs an even local sequence length "
                         f"(two chunks per rank), got {s}")
    return q.reshape(b, kv_heads, heads // kv_heads, s, d), k, v


def from_grouped(out: jax.Array, layout: str) -> jax.Array:
    """``[b, kv_heads, group, s, d]`` back to ``[b, heads, s, d]`` in ``layout``."""
    b, kv_heads, group, s, d = out.shape
    out = out.reshape(b, kv_heads * group, s, d)
    return jnp.swapaxes(out, 1, 2) if layout == "bsnd" else out


def default_scale(q: jax.Array, scale: float | None) -> float:
    """``scale`` or ``1 / sqrt(head_dim)``."""
    return float(q.shape[-1]) ** -0.5 if scale is None else float(scale)


def check_segment_ids(segment_ids: jax.Array, q_grouped: jax.Array) -> jax.Array:
    """``segment_ids`` as int32 after checking they are ``[b, local seq]`` of the grouped queries
    ``[b, kv_heads, group, local seq, d]``; raises ``ValueError`` otherwise."""
    b, s = q_grouped.shape[0], q_grouped.shape[3]
    if segment_ids.shape != (b, s):
        raise ValueError(f"segment_ids must be [batch, local seq] = {(b, s)}, got {segment_ids.shape}")
    return segment_ids.astype(jnp.int32)


def mask_other_documents(s: jax.Array, q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
    """Grouped scores ``s [b, kv_heads, group, q, k]`` set to -inf where the query's segment id
    (``q_seg [b, q]``) differs from the key's (``k_seg [b, k]``): the document mask."""
    return jnp.where((q_seg[:, :, None] == k_seg[:, None, :])[:, None, None], s, -jnp.inf)


def grouped_dropout(dropout: tuple[jax.Array, float] | None, q_grouped: jax.Array
                    ) -> tuple[jax.Array | None, float]:
    """``(keys, rate)`` with the ``[b, heads]`` keys reshaped to the grouped queries' ``[b,
    kv_heads, group]`` (query head ``i`` is group ``i // group``, member ``i % group``), or
    ``(None, 0.0)`` without dropout; raises ``ValueError`` for keys of another shape."""
    if dropout is None or not dropout[1]:
        return None, 0.0
    keys, rate = dropout
    b, kv_heads, group = q_grouped.shape[:3]
    if keys.shape != (b, kv_heads * group):
        raise ValueError(f"dropout keys must be [batch, heads] = {(b, kv_heads * group)}, got {keys.shape}")
    return keys.reshape(b, kv_heads, group), float(rate)
