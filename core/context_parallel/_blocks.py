"""The blockwise attention both context-parallel kernels run (the ring, ``ring_attention.py``,
and the all-gather, ``all_gather_attention.py``): the causal schedule of (query slot, key slot)
products per step, the block products and their online-softmax merge, and their backward.

Causal schedule. The local sequence is cut into *slots*: with ``load_balanced`` two (chunks
``r`` and ``2cp-1-r`` of the ``2 cp`` global chunks, see ``load_balance.py``), else one (chunk
``r`` of ``cp``). At step ``t`` rank ``r`` holds the K/V of source rank ``j = (r - t) mod cp``,
and :data:`SCHEDULES` lists which (query slot, key slot) products that needs: step 0 is the
local diagonal, then ``j < r`` ("below") or ``j > r`` ("above"). Products entirely above the
causal diagonal are absent from the table, so they are never computed (``lax.cond`` picks the
branch per rank), not masked. With load balancing each step after the first is two full chunk
products on every rank; without, rank ``r`` does ``r + 1`` products, so the last rank does
``cp`` times the first rank's work and the others wait for it. :func:`block_products` counts the table
entries the kernel runs, from the same table.

Document mask (``segment_ids``, ``--reset-attention-mask``). The local segment ids follow the
load-balanced order like the tokens; the K-side ids go with their K/V block (around the ring,
or gathered with it; forward and backward) and every block product masks keys of another document to -inf, on top
of the causal schedule above (still no product above the diagonal). A query row can then have
no key in a block (its document starts after the block): that block gives output 0 and LSE
-inf, and the merge weighs it by 0 rather than by the NaN of ``-inf - -inf``; every row keeps
its own position, so the merged LSE is finite.

Attention dropout (``dropout``). Each block product draws its keep-mask from the global token
indices of its query and key chunks (``dropout.py``: the values one device draws for the whole
``[s, s]`` matrix) and drops the block's normalised probabilities; the LSE stays the undropped
one, so the merge is unchanged, and the backward redraws the same mask.

Block products (:func:`kernel_block`). On the CPU backend, with float32 inputs, chunk length
and head dim multiples of 16 and the C++ attention kernel built
(``core/fusions/fused_attention.py``), each block product is one kernel call: causal for a
diagonal block, unmasked for a full one; its (output, LSE) merge like the einsum path's. The
backward calls the kernel's backward per block with the global output and LSE, which
gives exactly that block's share of the gradients (``D = rowsum(dO * O)`` and
``P = exp(S - LSE)`` are the global ones). The kernel wants K/V with the queries' shape, so
with grouped-query attention a block's K/V heads are repeated to the group (and their
gradients summed back) in memory; the K/V that are exchanged stay ungrouped. A ``scale`` other than
``1 / sqrt(head_dim)`` (the kernel's) is applied to q before the kernel, and to dq after.
Everywhere else (GPU, TPU, bfloat16, other shapes, ``MCJ_FUSED_ATTENTION=0``, and under the
document mask or dropout, which the kernel cannot apply) the block products are XLA einsums;
on GPU that is XLA's own dot fusion, not cuDNN's fused attention
(``jax.nn.dot_product_attention``'s backward cannot be given the global output and LSE). An
einsum product of a chunk longer than :data:`QUERY_TILE` runs its query rows in tiles, so its
scores are ``[.., tile, chunk]``, linear in the chunk. Both paths give the same results up to
float rounding.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from core.context_parallel._inputs import (
    default_scale,
    mask_other_documents,
)
from core.context_parallel.dropout import apply_dropout, attention_dropout_mask
from core.context_parallel.load_balance import cp_positions
from core.fusions.fused_attention import (
    fused_attention_available,
    fused_attention_backward,
    fused_attention_block,
    fused_attention_forward,
)

F32 = jnp.float32

# A product is (query slot, key slot, causal-diagonal mask?). Step cases: "diag" (own K/V),
# "below" (source rank < own rank), "above" (source rank > own rank); non-causal has one case.
_Product = tuple[int, int, bool]
SCHEDULES: dict[tuple[bool, bool], dict[str, tuple[_Product, ...]]] = {
    # (causal, load_balanced). Own slots hold chunks (r, 2cp-1-r), the source's (j, 2cp-1-j).
    (True, True): {
        # r vs r causal, 2cp-1-r vs r full, 2cp-1-r vs 2cp-1-r causal; r vs 2cp-1-r is in the future.
        "diag": ((0, 0, True), (1, 0, False), (1, 1, True)),
        # j < r: both own chunks see chunk j; chunk 2cp-1-j lies after both.
        "below": ((0, 0, False), (1, 0, False)),
        # j > r: only chunk 2cp-1-r sees anything, and it sees both of the source's chunks.
        "above": ((1, 0, False), (1, 1, False)),
    },
    (True, False): {"diag": ((0, 0, True),), "below": ((0, 0, False),), "above": ()},
    (False, True): {"full": tuple((i, j, False) for i in range(2) for j in range(2))},
    (False, False): {"full": ((0, 0, False),)},
}
"""Per (causal, load_balanced), the block products of each step case: ``"diag"`` (step 0, the own
K/V), ``"below"`` and ``"above"`` (the source rank before or after this one), ``"full"`` (not causal)."""


def source_rank(rank, step, cp):
    """The rank whose K/V block rank ``rank`` computes with at step ``step`` (ints or traced)."""
    return (rank - step) % cp


def _below(rank, step, cp):
    """Whether ring step ``step`` (>= 1) of ``rank`` holds an earlier rank's K/V (ints or traced):
    the one predicate both the kernel's ``lax.cond`` and :func:`block_products` branch on."""
    return source_rank(rank, step, cp) < rank


def _step_case(rank: int, step: int, cp: int, causal: bool) -> str:
    """Host-side: which :data:`SCHEDULES` case ring step ``step`` of ``rank`` runs."""
    if not causal:
        return "full"
    if step == 0:
        return "diag"
    return "below" if _below(rank, step, cp) else "above"


def block_products(cp: int, load_balanced: bool = True, causal: bool = True) -> list[int]:
    """Per cp rank, how many (chunk x chunk) block products :func:`ring_attention` computes.

    A chunk is ``seq / (2 cp)`` tokens with ``load_balanced``, else ``seq / cp``; a causal
    diagonal block counts as one product. Read off the kernel's own schedule table. Causal and
    load-balanced: ``2 cp + 1`` on every rank (sum: the ``2cp (2cp + 1) / 2`` blocks of the causal
    triangle); causal without balancing: ``r + 1`` on rank ``r``.
    """
    table = SCHEDULES[(causal, load_balanced)]
    return [sum(len(table[_step_case(r, t, cp, causal)]) for t in range(cp)) for r in range(cp)]


def split_seq(x: jax.Array, n: int, axis: int) -> tuple[jax.Array, ...]:
    """``x`` cut into ``n`` equal slots along ``axis``."""
    return tuple(jnp.split(x, n, axis=axis))


QUERY_TILE = 1024
"""Einsum block products with more query rows than this run their rows in tiles of at most this
many (``lax.map`` / ``lax.scan``), so a product's float32 scores and probabilities take
``[b, h, g, tile, c]`` instead of ``[b, h, g, c, c]``: on GPUs, where the blocks are einsums, a
chunk of 32k tokens would otherwise need 4 GiB per head for one score matrix."""


def query_tiles(rows: int) -> int:
    """How many equal tiles of at most :data:`QUERY_TILE` rows an einsum block product of
    ``rows`` query rows runs in (the fewest that divide ``rows``; 1: untiled)."""
    n = -(-rows // QUERY_TILE)
    while rows % n:
        n += 1
    return n


def _scores(q: jax.Array, k: jax.Array, diag: bool, scale: float, segs=None, row0=0) -> jax.Array:
    """float32 ``q k^T * scale`` of ``q: [b, h, g, t, d]``, ``k: [b, h, c, d]``; causal-masked to -inf
    above the diagonal for a diagonal block (query and key chunk at the same global offset; q's
    rows are the chunk's rows ``row0 ..``), and, with ``segs = (q_seg [b, t], k_seg [b, c])``, to
    -inf between different documents."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q, k, preferred_element_type=F32) * scale
    if diag:
        rows = row0 + jnp.arange(s.shape[-2])
        s = jnp.where(rows[:, None] >= jnp.arange(s.shape[-1])[None, :], s, -jnp.inf)
    if segs is not None:
        s = mask_other_documents(s, *segs)
    return s


def _keep(drop) -> tuple[jax.Array | None, float]:
    """``(keep, rate)`` for :func:`apply_dropout` from ``drop = (keys, q_pos, k_pos, rate)`` (the
    block's global token indices): the keep-mask drawn here, at the (tile of the) block's own
    size; ``(None, 0.0)`` when ``drop`` is None (nothing dropped)."""
    return (None, 0.0) if drop is None else (attention_dropout_mask(*drop), drop[3])


def _block_forward(q, k, v, diag: bool, scale: float, segs=None, drop=None, row0=0):
    """One block product (or a tile of its query rows, from ``row0``): its softmax-normalised
    output (float32) and row LSE (-inf, output 0, for a row with no key left: possible only under
    the document mask, ``segs``). ``drop`` (see :func:`_keep`) drops probabilities after the
    normalisation (the LSE stays the undropped one, so the merge of blocks is unchanged)."""
    s = _scores(q, k, diag, scale, segs, row0)
    m = jnp.max(s, axis=-1, keepdims=True)  # finite without segs: every row has its diagonal key
    if segs is not None:  # a query whose document starts after this key block: exp(-inf - 0) = 0
        m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=-1, keepdims=True)
    safe = jnp.where(total > 0, total, 1.0) if segs is not None else total
    pd = apply_dropout(p, *_keep(drop))
    out = jnp.einsum("bhgqk,bhkd->bhgqd", pd.astype(v.dtype), v, preferred_element_type=F32) / safe
    return out, (m + jnp.log(total))[..., 0]  # log(0) = -inf for an empty row


def _row_tiles(n: int, q_rows, segs, drop):
    """The per-tile operands of a block product cut into ``n`` query-row tiles: each array of
    ``q_rows`` (``[b, h, g, c, ...]``, rows on axis 3) as ``[n, b, h, g, c/n, ...]``, the query
    side of ``segs`` and ``drop`` likewise, and every tile's first row."""
    def rows_first(x, axis):
        return jnp.moveaxis(x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1:]), axis, 0)

    tiled = tuple(rows_first(x, 3) for x in q_rows)
    q_seg = None if segs is None else rows_first(segs[0], 1)
    q_pos = None if drop is None else rows_first(drop[1], 0)
    return tiled, q_seg, q_pos, jnp.arange(n) * (q_rows[0].shape[3] // n)


def _tile_masks(segs, drop, q_seg, q_pos):
    """``segs`` and ``drop`` with their query side replaced by one tile's."""
    return (None if segs is None else (q_seg, segs[1]),
            None if drop is None else (drop[0], q_pos, *drop[2:]))


def _rows_back(x: jax.Array) -> jax.Array:
    """``[n, b, h, g, t, ...]`` tiles back to ``[b, h, g, n t, ...]``."""
    x = jnp.moveaxis(x, 0, 3)
    return x.reshape(*x.shape[:3], x.shape[3] * x.shape[4], *x.shape[5:])


def _einsum_block_forward(q, k, v, diag: bool, scale: float, segs=None, drop=None):
    """:func:`_block_forward` of a whole block product, its query rows in :func:`query_tiles` tiles."""
    n = query_tiles(q.shape[3])
    if n == 1:
        return _block_forward(q, k, v, diag, scale, segs, drop)
    (qt,), q_seg, q_pos, row0 = _row_tiles(n, (q,), segs, drop)

    def tile(x):
        t_q, t_seg, t_pos, t_row0 = x
        return _block_forward(t_q, k, v, diag, scale, *_tile_masks(segs, drop, t_seg, t_pos), row0=t_row0)

    out, lse = lax.map(tile, (qt, q_seg, q_pos, row0))
    return _rows_back(out), _rows_back(lse)


def kernel_block(q_chunk: jax.Array, k: jax.Array, v: jax.Array) -> int | None:
    """The CPU attention kernel's block size for the ring's block products of the query chunk
    ``q_chunk: [b, h, g, c, d]`` (one slot) against ``k, v: [b, h, *, d]``, or None where the
    products stay XLA einsums: not the CPU backend, not all float32, ``c`` or ``d`` not a
    multiple of 16, or the kernel unavailable (module doc)."""
    if jax.default_backend() != "cpu" or not q_chunk.dtype == k.dtype == v.dtype:
        return None
    block = fused_attention_block(q_chunk, q_chunk, q_chunk)
    return block if block is not None and fused_attention_available() else None


def _to_query_heads(x: jax.Array, group: int) -> jax.Array:
    """K/V ``[b, h, c, d]`` repeated to the queries' ``[b, h, group, c, d]`` (the kernel's shape)."""
    return jnp.broadcast_to(x[:, :, None], (x.shape[0], x.shape[1], group, *x.shape[2:]))


def _kernel_q(q: jax.Array, scale: float) -> tuple[jax.Array, float]:
    """q rescaled so the kernel's ``1 / sqrt(d)`` gives ``scale``, and the factor (1.0: q as is)."""
    factor = scale / default_scale(q, None)
    return (q if factor == 1.0 else q * factor), factor


def _kernel_block_forward(q, k, v, diag: bool, scale: float, block: int):
    """:func:`_block_forward` with the CPU kernel: causal for a diagonal block, else unmasked."""
    group = q.shape[2]
    q, _ = _kernel_q(q, scale)
    return fused_attention_forward(q, _to_query_heads(k, group), _to_query_heads(v, group), block, diag)


def _kernel_block_backward(q, k, v, do, out, lse, diag: bool, scale: float, block: int):
    """:func:`_block_backward` with the CPU kernel, given the global output and LSE of q's rows."""
    group = q.shape[2]
    q, factor = _kernel_q(q, scale)
    dq, dk, dv = fused_attention_backward(q, _to_query_heads(k, group), _to_query_heads(v, group), out, lse, do,
                                          block, diag)
    return (dq if factor == 1.0 else dq * factor), jnp.sum(dk, axis=2), jnp.sum(dv, axis=2)


def _merge(acc, block):
    """Online-softmax merge of a block's (output, LSE) into the accumulator's."""
    out, lse = acc
    b_out, b_lse = block
    new = jnp.logaddexp(lse, b_lse)  # the -inf initial LSE contributes exp(-inf) = 0
    # Both -inf (a row with no key yet, document mask): weigh by exp(-inf - 0) = 0, not by NaN.
    ref = jnp.where(jnp.isfinite(new), new, 0.0)
    return out * jnp.exp(lse - ref)[..., None] + b_out * jnp.exp(b_lse - ref)[..., None], new


def _block_masks(k_seg, k_pos, q_segs, keys, q_pos, rate: float, n: int):
    """Per (query slot, key slot) the ``(segs, drop)`` of the block functions, both None when
    unused: the document mask's ``(q_seg, k_seg)`` and the dropout's ``(keys, q_pos, k_pos,
    rate)``, the slots' global token indices (``q_pos`` per query slot, ``k_pos`` of the held
    block) from which each product draws its keep-mask (:func:`_keep`)."""
    k_segs = None if q_segs is None else split_seq(k_seg, n, 1)
    k_poss = None if keys is None else jnp.split(k_pos, n)

    def at(qi, ki):
        segs = None if q_segs is None else (q_segs[qi], k_segs[ki])
        drop = None if keys is None else (keys, q_pos[qi], k_poss[ki], rate)
        return segs, drop

    return at


def forward_products(products, qs, k, v, k_seg, k_pos, acc, scale, block, masks):
    """The block products of one ring step merged into the accumulators (``block``: the CPU
    kernel's block size, or None for einsums; ``masks``: :func:`_block_masks` but for the held
    block's segment ids and token indices)."""
    ks, vs = split_seq(k, len(qs), 2), split_seq(v, len(qs), 2)
    at = masks(k_seg, k_pos)
    acc = list(acc)
    for qi, ki, diag in products:
        if block is None:
            b_out = _einsum_block_forward(qs[qi], ks[ki], vs[ki], diag, scale, *at(qi, ki))
        else:
            b_out = _kernel_block_forward(qs[qi], ks[ki], vs[ki], diag, scale, block)
        acc[qi] = _merge(acc[qi], b_out)
    return tuple(acc)


def run_step(table, causal, rank, step, cp, fn, *operands):
    """Run ``fn(products, *operands)`` for ring step ``step`` (static 0 or traced): the case is
    chosen by ``lax.cond`` on the traced source rank, so the other case's products are not run."""
    if not causal:
        return fn(table["full"], *operands)
    if isinstance(step, int) and step == 0:
        return fn(table["diag"], *operands)
    return lax.cond(_below(rank, step, cp), partial(fn, table["below"]), partial(fn, table["above"]),
                    *operands)


def block_size_for(q_chunk, k, v, seg, keys):
    """:func:`kernel_block`, or None (einsums) under the document mask or dropout: the kernel has
    no arbitrary mask (only causal or none) nor dropout; the einsum path applies both per block."""
    return None if seg is not None or keys is not None else kernel_block(q_chunk, k, v)


def masks_and_positions(q, seg, keys, rate, rank, cp, load_balanced, n_slots):
    """This rank's :func:`_block_masks` (less the held block's ids and indices) and the function
    from a ring step to the global token indices of the K/V block then held (None without dropout)."""
    seq = cp * q.shape[3]
    q_segs = None if seg is None else split_seq(seg, n_slots, 1)
    q_pos = None if keys is None else jnp.split(jnp.asarray(cp_positions(rank, seq, cp, load_balanced=load_balanced)),
                                                n_slots)
    masks = partial(_block_masks, q_segs=q_segs, keys=keys, q_pos=q_pos, rate=rate, n=n_slots)
    k_pos = lambda step: None if keys is None else cp_positions(source_rank(rank, step, cp), seq, cp,
                                                                load_balanced=load_balanced)
    return masks, k_pos


def _block_backward(q, k, v, do, lse, delta, diag: bool, scale: float, segs=None, drop=None, row0=0):
    """Flash attention's backward of one block (or a tile of its query rows, from ``row0``),
    probabilities recomputed from the saved LSE (the ring's global one, finite: masked keys give
    exp(-inf) = 0). With dropout, dV reads the dropped probabilities and dP the kept entries;
    ``delta = rowsum(dO * O)`` of the dropped output is still ``rowsum(P * dP)``."""
    p = jnp.exp(_scores(q, k, diag, scale, segs, row0) - lse[..., None])
    keep, rate = _keep(drop)
    pd = apply_dropout(p, keep, rate)
    dv = jnp.einsum("bhgqk,bhgqd->bhkd", pd.astype(do.dtype), do, preferred_element_type=F32)
    dp = apply_dropout(jnp.einsum("bhgqd,bhkd->bhgqk", do, v, preferred_element_type=F32), keep, rate)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(k.dtype), k, preferred_element_type=F32) * scale
    dk = jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(q.dtype), q, preferred_element_type=F32) * scale
    return dq, dk, dv


def _einsum_block_backward(q, k, v, do, lse, delta, diag: bool, scale: float, segs=None, drop=None):
    """:func:`_block_backward` of a whole block product, its query rows in :func:`query_tiles`
    tiles: dq per tile, dK/dV summed over the tiles."""
    n = query_tiles(q.shape[3])
    if n == 1:
        return _block_backward(q, k, v, do, lse, delta, diag, scale, segs, drop)
    tiles, q_seg, q_pos, row0 = _row_tiles(n, (q, do, lse, delta), segs, drop)

    def tile(dkv, x):
        (t_q, t_do, t_lse, t_delta), t_seg, t_pos, t_row0 = x
        dq, dk, dv = _block_backward(t_q, k, v, t_do, t_lse, t_delta, diag, scale,
                                     *_tile_masks(segs, drop, t_seg, t_pos), row0=t_row0)
        return (dkv[0] + dk, dkv[1] + dv), dq

    zeros = (jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
    (dk, dv), dq = lax.scan(tile, zeros, (tiles, q_seg, q_pos, row0))
    return _rows_back(dq), dk, dv


def backward_products(products, qs, dos, outs, lses, deltas, scale, block, dq, k, v, k_seg, k_pos, masks):
    """Block gradients of one ring step: dq accumulated locally, this step's dK/dV (float32)
    returned (``block``: the CPU kernel's block size, or None for einsums; ``masks`` as in
    :func:`forward_products`)."""
    n = len(qs)
    ks, vs = split_seq(k, n, 2), split_seq(v, n, 2)
    at = masks(k_seg, k_pos)
    dq = list(dq)
    dks = [jnp.zeros(x.shape, F32) for x in ks]
    dvs = [jnp.zeros(x.shape, F32) for x in vs]
    for qi, ki, diag in products:
        if block is None:
            g_q, g_k, g_v = _einsum_block_backward(qs[qi], ks[ki], vs[ki], dos[qi], lses[qi], deltas[qi], diag,
                                                   scale, *at(qi, ki))
        else:
            g_q, g_k, g_v = _kernel_block_backward(qs[qi], ks[ki], vs[ki], dos[qi], outs[qi], lses[qi], diag,
                                                   scale, block)
        dq[qi] = dq[qi] + g_q
        dks[ki] = dks[ki] + g_k
        dvs[ki] = dvs[ki] + g_v
    return tuple(dq), jnp.concatenate(dks, axis=2), jnp.concatenate(dvs, axis=2)


def forward_steps(q, k, v, seg, keys, rank, cp, causal, load_balanced, scale, rate):
    """One rank's forward as steps, for both variants (the ring and the all-gather differ only in
    how the block of a step arrives): ``(compute, acc)``, where ``compute(step, (k, v, seg), acc)``
    merges the step's block products with the block held into the per-slot (output, LSE)
    accumulators and ``acc`` is their start (:func:`forward_result` reads them out)."""
    n_slots = 2 if load_balanced else 1
    table = SCHEDULES[(causal, load_balanced)]
    qs = split_seq(q, n_slots, 3)
    masks, k_pos = masks_and_positions(q, seg, keys, rate, rank, cp, load_balanced, n_slots)
    step_fn = partial(forward_products, scale=scale, block=block_size_for(qs[0], k, v, seg, keys), masks=masks)

    def compute(step, kv, acc):
        pos = k_pos(step)
        return run_step(table, causal, rank, step, cp,
                        lambda prods, a, kk, vv, ss: step_fn(prods, qs, kk, vv, ss, pos, a), acc, *kv)

    return compute, tuple((jnp.zeros(x.shape, F32), jnp.full(x.shape[:-1], -jnp.inf, F32)) for x in qs)


def forward_result(acc):
    """The (output, LSE) of :func:`forward_steps`' accumulators, the slots concatenated."""
    return jnp.concatenate([o for o, _ in acc], axis=3), jnp.concatenate([lse for _, lse in acc], axis=3)


def backward_steps(q, k, v, seg, keys, out, lse, do, rank, cp, causal, load_balanced, scale, rate):
    """One rank's backward as steps, for both variants: ``(compute, dq)``, where
    ``compute(step, (k, v, seg), dq)`` returns dq with the step's block products added and the
    held block's dK/dV share (float32), and ``dq`` is the per-slot start (zeros)."""
    n_slots = 2 if load_balanced else 1
    table = SCHEDULES[(causal, load_balanced)]
    qs, dos, lses = split_seq(q, n_slots, 3), split_seq(do, n_slots, 3), split_seq(lse, n_slots, 3)
    masks, k_pos = masks_and_positions(q, seg, keys, rate, rank, cp, load_balanced, n_slots)
    block = block_size_for(qs[0], k, v, seg, keys)
    if block is None:
        delta = jnp.sum(do.astype(F32) * out.astype(F32), axis=-1)  # rowsum(dO * O)
        outs, deltas = None, split_seq(delta, n_slots, 3)
    else:  # the kernel computes rowsum(dO * O) itself from the global output
        outs, deltas = split_seq(out, n_slots, 3), None
    step_fn = partial(backward_products, qs=qs, dos=dos, outs=outs, lses=lses, deltas=deltas, scale=scale,
                      block=block, masks=masks)

    def compute(step, kv, dq):
        pos = k_pos(step)
        return run_step(table, causal, rank, step, cp,
                        lambda prods, g, kk, vv, ss: step_fn(prods, dq=g, k=kk, v=vv, k_seg=ss, k_pos=pos), dq, *kv)

    return compute, tuple(jnp.zeros(x.shape, F32) for x in qs)
