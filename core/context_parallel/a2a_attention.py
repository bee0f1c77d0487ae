"""All-to-all context parallelism (DeepSpeed-Ulysses; Megatron's ``--cp-comm-type a2a`` and ``a2a+p2p``).

Each cp rank enters with its load-balanced chunks of the sequence and all of its (tp-local)
heads. An all-to-all over the a2a group turns that sequence split into a head split: member
``i`` of a group of ``A`` ranks receives head group ``i`` (``heads / A`` heads) of every member's
tokens. Reordering the received chunks (:func:`~core.context_parallel.load_balance.restore_from_cp`
with ``A``) gives

* for ``a2a`` (``A = cp``): the whole sequence in its natural order, so the backend's ordinary
  causal attention runs on it (``core.transformer.dot_product_attention.causal_attention``: the
  C++ kernel on CPU, cuDNN on GPU) with a plain causal mask;
* for ``a2a+p2p`` (``A x B = cp``): the group's ``A`` ranks' chunks as the two load-balanced
  chunks ``j`` and ``2B-1-j`` of a ``B``-rank split, so the ring (``ring_attention.py``) runs
  across the ``B`` groups, over the ranks with the same member index (stride ``A``).

A second all-to-all sends each head group's output back to the tokens' owners. Both are linear,
so autodiff gives the backward (all-to-alls of dO before, of dQ/dK/dV after the attention's own
backward) and no custom VJP is needed.

Groups, as Megatron's ``create_hierarchical_groups``: cp rank ``r = j A + i`` is member ``i`` of
a2a group ``j`` (``A`` consecutive ranks, the fast links) and position ``j`` of ring ``i``
(stride ``A``). The mesh keeps its one ``"cp"`` axis: a whole-axis exchange is one
``lax.all_to_all``; a group exchange is ``A - 1`` ``lax.ppermute`` rounds whose pairs stay inside
the groups (shard_map has no ``axis_index_groups``), or, on the CPU backend inside pipeline stages
where XLA's collective-permute rendezvouses every device (``ring_attention.py``), an all-gather
over the cp axis of which each rank keeps its group's blocks.

Grouped-query attention: query heads must divide by ``A``. K/V heads that divide by ``A`` are
split the same way (TransformerEngine's only case: query head block ``i`` reads K/V block ``i``);
otherwise each K/V head is repeated to ``lcm(kv_heads, A)`` heads before the exchange (what
TransformerEngine refuses and DeepSpeed-Ulysses does), which keeps query head block ``i`` on the
K/V heads of its own groups. The document mask's segment ids are exchanged with the tokens;
attention dropout is drawn per global head and (query, key) index (``dropout.py``), the values
every other layout draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from core.context_parallel._inputs import LAYOUTS, default_scale
from core.context_parallel.dropout import attention_dropout_mask
from core.context_parallel.load_balance import reorder_for_cp, restore_from_cp
from core.context_parallel.ring_attention import KV_ROTATIONS, ring_attention

GROUP_EXCHANGES = ("ppermute", "all_gather")
"""How an exchange inside a2a groups smaller than the cp axis travels (see the module doc); an
exchange over the whole axis is always one ``lax.all_to_all``."""


def group_all_to_all(x: jax.Array, axis_name: str, group: int, axis: int, via: str = "ppermute") -> jax.Array:
    """All-to-all inside groups of ``group`` consecutive ranks of ``axis_name``: ``x``'s ``axis``
    (size ``group``) indexes the destination member; in the result it indexes the source member
    (``out[.., m, ..]`` is member ``m``'s ``x[.., i, ..]`` on member ``i``). ``via`` (one of
    :data:`GROUP_EXCHANGES`) for groups smaller than the axis."""
    cp = lax.axis_size(axis_name)
    if x.shape[axis] != group or cp % group:
        raise ValueError(f"group all-to-all needs axis {axis} of size {group} dividing the {axis_name!r} size {cp}, "
                         f"got shape {x.shape}")
    if group == 1:
        return x
    if group == cp:
        return lax.all_to_all(x, axis_name, axis, axis)
    rank = lax.axis_index(axis_name)
    member, first = rank % group, rank - rank % group
    if via == "all_gather":
        everyone = lax.all_gather(x, axis_name)  # [cp, ...x]: each rank's blocks for every member
        mine = lax.dynamic_index_in_dim(everyone, member, axis + 1, keepdims=False)  # [cp, ...] for this member
        out = lax.dynamic_slice_in_dim(mine, first, group, axis=0)  # the group's ranks, in member order
        return jnp.moveaxis(out, 0, axis)
    if via != "ppermute":
        raise ValueError(f"via must be one of {GROUP_EXCHANGES}, got {via!r}")
    # Round t: every member sends its block for member i + t and receives member i - t's block for it.
    received = [lax.dynamic_index_in_dim(x, member, axis, keepdims=False)]
    for t in range(1, group):
        block = lax.dynamic_index_in_dim(x, (member + t) % group, axis, keepdims=False)
        perm = [(g + m, g + (m + t) % group) for g in range(0, cp, group) for m in range(group)]
        received.append(lax.ppermute(block, axis_name, perm))
    by_shift = jnp.stack(received, axis)  # index t: from member i - t
    return jnp.take(by_shift, (member - jnp.arange(group)) % group, axis=axis)


def _seq_to_heads(x: jax.Array, axis_name: str, group: int, layout: str, load_balanced: bool, via: str
                  ) -> jax.Array:
    """Local ``x`` (this rank's tokens, all heads) -> head group ``member`` over the group's tokens,
    in the order the attention reads (natural, or the ring's two chunks)."""
    h_ax, s_ax = layout.index("n"), layout.index("s")
    if group == lax.axis_size(axis_name):
        # One tiled all-to-all splits the heads and concatenates the sources' tokens in place
        # (fewer copies on the CPU than the reshape and moveaxis below).
        x = lax.all_to_all(x, axis_name, h_ax, s_ax, tiled=True)
    else:
        heads = x.shape[h_ax]
        x = x.reshape(*x.shape[:h_ax], group, heads // group, *x.shape[h_ax + 1:])  # head groups by destination
        x = group_all_to_all(x, axis_name, group, h_ax, via)  # axis h_ax: the source member's tokens
        x = jnp.moveaxis(x, h_ax, s_ax)  # the source axis just before its tokens
        x = x.reshape(*x.shape[:s_ax], group * x.shape[s_ax + 1], *x.shape[s_ax + 2:])
    return restore_from_cp(x, group, seq_axis=s_ax) if load_balanced else x


def _heads_to_seq(x: jax.Array, axis_name: str, group: int, layout: str, load_balanced: bool, via: str
                  ) -> jax.Array:
    """The inverse of :func:`_seq_to_heads`: this rank's head group over the group's tokens back to
    this rank's tokens with all heads."""
    h_ax, s_ax = layout.index("n"), layout.index("s")
    if load_balanced:
        x = reorder_for_cp(x, group, seq_axis=s_ax)
    if group == lax.axis_size(axis_name):
        return lax.all_to_all(x, axis_name, s_ax, h_ax, tiled=True)
    x = x.reshape(*x.shape[:s_ax], group, x.shape[s_ax] // group, *x.shape[s_ax + 1:])  # by owning member
    x = jnp.moveaxis(x, s_ax, h_ax)
    x = group_all_to_all(x, axis_name, group, h_ax, via)  # axis h_ax: the source member's head group
    return x.reshape(*x.shape[:h_ax], x.shape[h_ax] * x.shape[h_ax + 1], *x.shape[h_ax + 2:])


def kv_heads_for_a2a(heads: int, kv_heads: int, group: int) -> int:
    """The K/V head count the exchange moves: ``kv_heads`` when ``group`` divides it, else
    ``lcm(kv_heads, group)`` (each K/V head repeated). Raises ``ValueError`` unless ``group``
    divides ``heads`` and ``kv_heads`` divides ``heads``."""
    if heads % group or heads % kv_heads:
        raise ValueError(f"all-to-all context parallelism needs the local query heads ({heads}) divisible by the "
                         f"a2a size ({group}) and by the K/V heads ({kv_heads})")
    return kv_heads if kv_heads % group == 0 else math.lcm(kv_heads, group)


def a2a_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: str = "cp", a2a_size: int | None = None,
                  causal: bool = True, load_balanced: bool = True, layout: str = "bnsd", scale: float | None = None,
                  kv_rotation: str = "ppermute", segment_ids: jax.Array | None = None,
                  dropout: tuple[jax.Array, float] | None = None, local_attention: Callable | None = None
                  ) -> jax.Array:
    """All-to-all context-parallel attention (call inside ``jax.shard_map``); returns the local
    queries' output, shaped, laid out and typed like ``q``.

    ``a2a_size`` ``A`` (default: the whole ``axis_name``, Megatron's ``a2a``) is the a2a group;
    below the axis size the ring of ``cp / A`` ranks runs across the groups (``a2a+p2p``; the
    ring's ``kv_rotation``, and the group exchanges' ``via``: ``"all_gather"`` rotation means
    all-gather exchanges too). Other arguments as :func:`~core.context_parallel.ring_attention.ring_attention`:
    local q/k/v in ``layout`` (K/V may have fewer heads: GQA, see the module doc), ``load_balanced``
    (the local sequence is chunks ``r`` and ``2cp-1-r``), ``segment_ids`` ``[b, local seq]``,
    ``dropout = (keys [b, heads], rate)``. ``local_attention``: the backend's causal attention run
    on the whole sequence, ``(q, k, v, layout, *, segment_ids, dropout_keep, dropout_rate)``
    (``core.transformer.dot_product_attention.causal_attention``, which ``ParallelAttention``
    passes; this package sits below ``core.transformer`` and does not import it). Only causal
    attention (the backend's kernels are causal);
    raises ``ValueError`` for ``causal=False``, heads that do not split, or an ``A`` that does
    not divide the cp size.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if kv_rotation not in KV_ROTATIONS:
        raise ValueError(f"kv_rotation must be one of {KV_ROTATIONS}, got {kv_rotation!r}")
    if not causal:
        raise ValueError("all-to-all context parallelism runs the backend's causal attention; causal=False is "
                         "not supported (use comm_type 'p2p' or 'all_gather')")
    if local_attention is None:
        raise ValueError("all-to-all context parallelism needs local_attention, the backend's causal attention "
                         "(core.transformer.dot_product_attention.causal_attention)")
    cp = lax.axis_size(axis_name)
    group = cp if a2a_size is None else int(a2a_size)
    if group < 1 or cp % group:
        raise ValueError(f"a2a size {group} must divide the {axis_name!r} size {cp}")
    h_ax, s_ax = layout.index("n"), layout.index("s")
    heads, kv_heads, local = q.shape[h_ax], k.shape[h_ax], q.shape[s_ax]
    if k.shape != v.shape or k.shape[s_ax] != local:
        raise ValueError(f"k/v {k.shape}, {v.shape} do not match q {q.shape} in local sequence (layout {layout!r})")
    if load_balanced and local % 2:
        raise ValueError(f"load-balanced context parallelism needs an even local sequence length, got {local}")
    moved_kv = kv_heads_for_a2a(heads, kv_heads, group)
    if moved_kv != kv_heads:
        k, v = (jnp.repeat(x, moved_kv // kv_heads, axis=h_ax) for x in (k, v))
    via = "all_gather" if kv_rotation == "all_gather" else "ppermute"
    to_heads = lambda x: _seq_to_heads(x, axis_name, group, layout, load_balanced, via)  # noqa: E731
    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    member = lax.axis_index(axis_name) % group
    seg = None
    if segment_ids is not None:
        if segment_ids.shape != (q.shape[0], local):
            raise ValueError(f"segment_ids must be [batch, local seq] = {(q.shape[0], local)}, got {segment_ids.shape}")
        # Every member needs the group's ids: the same block sent to each, exchanged like the tokens.
        ids = jnp.broadcast_to(segment_ids.astype(jnp.int32)[:, None], (q.shape[0], group, local))
        ids = group_all_to_all(ids, axis_name, group, 1, via)
        ids = ids.reshape(q.shape[0], group * local)
        seg = restore_from_cp(ids, group, seq_axis=1) if load_balanced else ids
    keys, rate = None, 0.0
    if dropout is not None and dropout[1]:
        keys, rate = dropout
        if keys.shape != (q.shape[0], heads):
            raise ValueError(f"dropout keys must be [batch, heads] = {(q.shape[0], heads)}, got {keys.shape}")
        keys = lax.dynamic_slice_in_dim(keys, member * (heads // group), heads // group, axis=1)  # this head group
    scale = default_scale(q, scale)
    if group == cp:
        out = _full_sequence_attention(local_attention, qh, kh, vh, layout, scale, seg, keys, rate)
    else:
        out = ring_attention(qh, kh, vh, axis_name=axis_name, causal=True, load_balanced=load_balanced, layout=layout,
                             scale=scale, kv_rotation=kv_rotation, segment_ids=seg,
                             dropout=None if keys is None else (keys, rate), ring_stride=group)
    return _heads_to_seq(out, axis_name, group, layout, load_balanced, via)


def _full_sequence_attention(local_attention, q, k, v, layout, scale, seg, keys, rate):
    """The backend's causal attention on the whole sequence of this rank's head group; a ``scale``
    other than ``1 / sqrt(head_dim)`` (the backend's) is folded into q."""
    native = float(q.shape[-1]) ** -0.5
    if scale != native:
        q = (q * (scale / native)).astype(q.dtype)
    keep = None
    if keys is not None:
        positions = jnp.arange(q.shape[layout.index("s")])
        keep = attention_dropout_mask(keys, positions, positions, rate)
    return local_attention(q, k, v, layout, segment_ids=seg, dropout_keep=keep, dropout_rate=rate)
