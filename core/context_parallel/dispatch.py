"""One entry point for context-parallel attention, by communication type (Megatron's ``--cp-comm-type``)."""

from __future__ import annotations

from collections.abc import Callable

import jax

from core.context_parallel.a2a_attention import a2a_attention
from core.context_parallel.all_gather_attention import all_gather_attention
from core.context_parallel.ring_attention import ring_attention

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""Supported ``comm_type`` values: ring exchange of K/V blocks, an all-gather of K/V, an all-to-all
from the sequence split to a head split (Ulysses), and that all-to-all inside groups with the ring
across them."""


def context_parallel_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, comm_type: str = "p2p",
                               axis_name: str = "cp", causal: bool = True, load_balanced: bool = True,
                               layout: str = "bnsd", scale: float | None = None,
                               kv_rotation: str = "ppermute", segment_ids: jax.Array | None = None,
                               dropout: tuple[jax.Array, float] | None = None,
                               hierarchical_sizes: tuple[int, int] | None = None,
                               local_attention: Callable | None = None) -> jax.Array:
    """Attention over a sequence split across the context-parallel axis ``axis_name``, called inside
    ``jax.shard_map`` with this rank's local q/k/v; ``comm_type`` is ``"p2p"``
    (:func:`~core.context_parallel.ring_attention.ring_attention`), ``"all_gather"``
    (:func:`~core.context_parallel.all_gather_attention.all_gather_attention`), ``"a2a"`` or
    ``"a2a+p2p"`` (:func:`~core.context_parallel.a2a_attention.a2a_attention`; the latter with
    ``hierarchical_sizes = (a2a size, ring size)``, Megatron's
    ``--hierarchical-context-parallel-sizes``, whose product is the cp size). ``kv_rotation``
    is the ring's (see :func:`~core.context_parallel.ring_attention.kv_rotation_for`; for the
    a2a types also how in-group exchanges travel); the all-gather kernel has no ring and ignores
    it. ``segment_ids`` (``[b, local seq]`` ints in the local tokens' order, optional) add the
    document mask (``--reset-attention-mask``); ``dropout = (keys [b, heads], rate)`` the
    attention dropout, drawn per global (query, key) token index
    (:func:`~core.context_parallel.dropout.attention_dropout_mask`). ``local_attention`` (the a2a
    types): the backend's causal attention the head split runs
    (``core.transformer.dot_product_attention.causal_attention``). Raises ``ValueError`` for
    an unknown ``comm_type`` or layout, mismatched shapes, (with ``load_balanced``) a local
    sequence that does not split into the rank's two chunks, ``"a2a+p2p"`` without
    ``hierarchical_sizes`` or with sizes whose product is not the cp size.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"comm_type must be one of {COMM_TYPES}, got {comm_type!r}")
    common = dict(axis_name=axis_name, causal=causal, load_balanced=load_balanced, layout=layout, scale=scale,
                  segment_ids=segment_ids, dropout=dropout)
    if comm_type == "p2p":
        return ring_attention(q, k, v, kv_rotation=kv_rotation, **common)
    if comm_type == "all_gather":
        return all_gather_attention(q, k, v, **common)
    a2a_size = None
    if comm_type == "a2a+p2p":
        if hierarchical_sizes is None or len(hierarchical_sizes) != 2:
            raise ValueError(f"comm_type 'a2a+p2p' needs hierarchical_sizes (a2a size, ring size), got "
                             f"{hierarchical_sizes!r}")
        a2a_size, ring_size = (int(x) for x in hierarchical_sizes)
        cp = jax.lax.axis_size(axis_name)
        if a2a_size * ring_size != cp:
            raise ValueError(f"hierarchical_sizes {a2a_size} x {ring_size} must equal the {axis_name!r} size {cp}")
    return a2a_attention(q, k, v, a2a_size=a2a_size, kv_rotation=kv_rotation, local_attention=local_attention,
                         **common)
