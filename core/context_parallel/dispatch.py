"""One entry point for context-parallel attention, by communication type (Megatron's ``--cp-comm-type``)."""

from __future__ import annotations

import jax

from core.context_parallel.all_gather_attention import all_gather_attention
from core.context_parallel.ring_attention import ring_attention

COMM_TYPES = ("p2p", "all_gather")
"""Supported ``comm_type`` values: ring exchange of K/V blocks, or an all-gather of K/V."""


def context_parallel_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, comm_type: str = "p2p",
                               axis_name: str = "cp", causal: bool = True, load_balanced: bool = True,
                               layout: str = "bnsd", scale: float | None = None,
                               kv_rotation: str = "ppermute", segment_ids: jax.Array | None = None,
                               dropout: tuple[jax.Array, float] | None = None) -> jax.Array:
    """Attention over a sequence split across the context-parallel axis ``axis_name``, called inside
    ``jax.shard_map`` with this rank's local q/k/v; ``comm_type`` is ``"p2p"``
    (:func:`~core.context_parallel.ring_attention.ring_attention`) or ``"all_gather"``
    (:func:`~core.context_parallel.all_gather_attention.all_gather_attention`). ``kv_rotation``
    is the ring's (see :func:`~core.context_parallel.ring_attention.kv_rotation_for`); the
    all-gather kernel has no ring and ignores it. ``segment_ids`` (``[b, local seq]`` ints in the
    local tokens' order, optional) add the document mask (``--reset-attention-mask``); ``dropout =
    (keys [b, heads], rate)`` the attention dropout, drawn per global (query, key) token index
    (:func:`~core.context_parallel.dropout.attention_dropout_mask`). Raises
    ``ValueError`` for an unknown ``comm_type`` or layout, mismatched shapes, or (with
    ``load_balanced``) a local sequence that does not split into the rank's two chunks.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"comm_type must be one of {COMM_TYPES}, got {comm_type!r}")
    if comm_type == "p2p":
        return ring_attention(q, k, v, axis_name=axis_name, causal=causal, load_balanced=load_balanced,
                              layout=layout, scale=scale, kv_rotation=kv_rotation, segment_ids=segment_ids,
                              dropout=dropout)
    return all_gather_attention(q, k, v, axis_name=axis_name, causal=causal, load_balanced=load_balanced,
                                layout=layout, scale=scale, segment_ids=segment_ids, dropout=dropout)
