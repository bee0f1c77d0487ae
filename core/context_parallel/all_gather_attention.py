"""All-gather context-parallel attention (Megatron's ``--cp-comm-type all_gather``, MaxText's default).

Each rank keeps its local queries and all-gathers K/V over the cp axis, then runs ordinary
masked attention against the whole (reordered) sequence. Simpler than the ring and with one
collective per tensor, but the gather cannot overlap the compute and every rank holds the full
K/V plus a ``[local, global]`` score matrix. Plain differentiable ops: under ``shard_map``
autodiff the transpose of ``lax.all_gather`` is a reduce-scatter, which sums every rank's
contribution to a K/V block's gradient onto its owner. The causal mask compares global
positions (:func:`core.context_parallel.load_balance.cp_positions`), so the load-balanced chunk
order is respected; masked blocks are computed and discarded, not skipped. The document mask
(``segment_ids``) gathers the segment ids over cp with K/V and ands their equality into the mask;
dropout draws the local rows against all keys by global token index (``dropout.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from core.context_parallel._inputs import (
    check_segment_ids,
    default_scale,
    from_grouped,
    grouped_dropout,
    mask_other_documents,
    to_grouped,
)
from core.context_parallel.dropout import apply_dropout, attention_dropout_mask
from core.context_parallel.load_balance import cp_positions

_F32 = jnp.float32


def all_gather_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: str = "cp", causal: bool = True,
                         load_balanced: bool = True, layout: str = "bnsd", scale: float | None = None,
                         segment_ids: jax.Array | None = None,
                         dropout: tuple[jax.Array, float] | None = None) -> jax.Array:
    """Context-parallel attention with K/V all-gathered over ``axis_name`` (call inside
    ``jax.shard_map``); returns the local queries' output, shaped, laid out and typed like ``q``.

    Arguments as :func:`core.context_parallel.ring_attention.ring_attention`: local q/k/v in
    ``layout``, K/V heads may divide the query heads (GQA), ``load_balanced`` says the local
    sequence is chunks ``r`` and ``2cp-1-r``, ``segment_ids`` (``[b, local seq]``, optional) the
    document mask, ``dropout = (keys [b, heads], rate)`` the attention dropout. float32 scores
    and softmax.
    """
    qg, k, v = to_grouped(q, k, v, layout, load_balanced)
    scale = default_scale(q, scale)
    cp = lax.axis_size(axis_name)
    local = qg.shape[3]
    # tiled=True concatenates the ranks' local sequences in rank order: the reordered global sequence.
    k_all = lax.all_gather(k, axis_name, axis=2, tiled=True)
    v_all = lax.all_gather(v, axis_name, axis=2, tiled=True)
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k_all, preferred_element_type=_F32) * scale
    seq = cp * local
    q_pos = cp_positions(lax.axis_index(axis_name), seq, cp, load_balanced=load_balanced)
    # Key positions are the same on every rank: a host constant.
    k_pos = jnp.asarray(np.concatenate([cp_positions(i, seq, cp, load_balanced=load_balanced) for i in range(cp)]))
    if causal:
        s = jnp.where(q_pos[:, None] >= k_pos[None, :], s, -jnp.inf)
    if segment_ids is not None:
        q_seg = check_segment_ids(segment_ids, qg)
        k_seg = lax.all_gather(q_seg, axis_name, axis=1, tiled=True)  # same order as k_all
        s = mask_other_documents(s, q_seg, k_seg)
    p = jax.nn.softmax(s, axis=-1)  # every query row keeps at least its own position
    keys, rate = grouped_dropout(dropout, qg)
    if keys is not None:
        p = apply_dropout(p, attention_dropout_mask(keys, q_pos, k_pos, rate), rate)
    out = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v_all.dtype), v_all, preferred_element_type=_F32)
    return from_grouped(out.astype(q.dtype), layout)
