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

Causal schedule. The local sequence is cut into *slots*: with ``load_balanced`` two (chunks
``r`` and ``2cp-1-r`` of the ``2 cp`` global chunks, see ``load_balance.py``), else one (chunk
``r`` of ``cp``). At step ``t`` rank ``r`` holds the K/V of source rank ``j = (r - t) mod cp``,
and :data:`_SCHEDULES` lists which (query slot, key slot) products that needs: step 0 is the
local diagonal, then ``j < r`` ("below") or ``j > r`` ("above"). Products entirely above the
causal diagonal are absent from the table, so they are never computed (``lax.cond`` picks the
branch per rank), not masked. With load balancing each step after the first is two full chunk
products on every rank; without, rank ``r`` does ``r + 1`` products, so the last rank does
``cp`` times the first rank's work and the others wait for it. :func:`block_products` counts the table
entries the kernel runs, from the same table.

K/V rotation (``kv_rotation``). ``"ppermute"`` (the default, and the only one used off the CPU
backend) sends each block to the next rank with ``lax.ppermute``; on GPU that is NCCL
send/recv between the pair (not checked on a GPU in this project). XLA's CPU collective-permute
instead rendezvouses every device of the program (its key lists all of them), so when devices
outside the cp group run other code in between, as pipeline stages under the executor's
per-slot ``lax.cond`` do, a ring step waits for, or meets, another stage's collective-permute:
a hang or wrong K/V. ``"all_gather"`` does each hop with ``lax.all_gather`` over
``axis_name``, which rendezvouses per cp group, and keeps the previous rank's block: the same
values and schedule, but every hop moves ``cp - 1`` blocks to each rank instead of one and
holds ``cp`` blocks for the hop. :func:`kv_rotation_for` picks it on the CPU backend inside
pipeline stages only.

Document mask (``segment_ids``, ``--reset-attention-mask``). The local segment ids follow the
load-balanced order like the tokens; the K-side ids travel around the ring with their K/V block
(forward and backward) and every block product masks keys of another document to -inf, on top
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
backward calls the kernel's backward per block with the ring's global output and LSE, which
gives exactly that block's share of the gradients (``D = rowsum(dO * O)`` and
``P = exp(S - LSE)`` are the global ones). The kernel wants K/V with the queries' shape, so
with grouped-query attention a block's K/V heads are repeated to the group (and their
gradients summed back) in memory; only the ring's K/V stay ungrouped. A ``scale`` other than
``1 / sqrt(head_dim)`` (the kernel's) is applied to q before the kernel, and to dq after.
Everywhere else (GPU, TPU, bfloat16, other shapes, ``MCJ_FUSED_ATTENTION=0``, and under the
document mask or dropout, which the kernel cannot apply) the block products are XLA einsums as
before; on GPU that is XLA's own dot fusion, not cuDNN's fused attention
(``jax.nn.dot_product_attention``'s backward cannot be given the ring's global output and
LSE). Both paths give the same results up to float rounding.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
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
from core.fusions.fused_attention import (
    fused_attention_available,
    fused_attention_backward,
    fused_attention_block,
    fused_attention_forward,
)

_F32 = jnp.float32

KV_ROTATIONS = ("ppermute", "all_gather")
"""How a K/V block reaches the next ring rank: ``lax.ppermute``, or an all-gather over the cp axis
of which each rank keeps the previous rank's block (the CPU backend's fallback, see module doc)."""

# A product is (query slot, key slot, causal-diagonal mask?). Step cases: "diag" (own K/V),
# "below" (source rank < own rank), "above" (source rank > own rank); non-causal has one case.
_Product = tuple[int, int, bool]
_SCHEDULES: dict[tuple[bool, bool], dict[str, tuple[_Product, ...]]] = {
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


def _source(rank, step, cp):
    """The rank whose K/V block rank ``rank`` holds at ring step ``step`` (ints or traced)."""
    return (rank - step) % cp


def _below(rank, step, cp):
    """Whether ring step ``step`` (>= 1) of ``rank`` holds an earlier rank's K/V (ints or traced):
    the one predicate both the kernel's ``lax.cond`` and :func:`block_products` branch on."""
    return _source(rank, step, cp) < rank


def _step_case(rank: int, step: int, cp: int, causal: bool) -> str:
    """Host-side: which :data:`_SCHEDULES` case ring step ``step`` of ``rank`` runs."""
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
    table = _SCHEDULES[(causal, load_balanced)]
    return [sum(len(table[_step_case(r, t, cp, causal)]) for t in range(cp)) for r in range(cp)]


def _split_seq(x: jax.Array, n: int, axis: int) -> tuple[jax.Array, ...]:
    return tuple(jnp.split(x, n, axis=axis))


def _scores(q: jax.Array, k: jax.Array, diag: bool, scale: float, segs=None) -> jax.Array:
    """float32 ``q k^T * scale`` of ``q: [b, h, g, c, d]``, ``k: [b, h, c, d]``; causal-masked to -inf
    above the diagonal for a diagonal block (query and key chunk at the same global offset), and,
    with ``segs = (q_seg [b, c], k_seg [b, c])``, to -inf between different documents."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q, k, preferred_element_type=_F32) * scale
    if diag:
        c = s.shape[-1]
        s = jnp.where(jnp.tril(jnp.ones((c, c), dtype=bool)), s, -jnp.inf)
    if segs is not None:
        s = mask_other_documents(s, *segs)
    return s


def _block_forward(q, k, v, diag: bool, scale: float, segs=None, drop=None):
    """One block product: its softmax-normalised output (float32) and row LSE (-inf, output 0, for
    a row with no key left: possible only under the document mask, ``segs``). ``drop = (keep,
    rate)`` drops probabilities after the normalisation (the LSE stays the undropped one, so the
    merge of blocks is unchanged)."""
    s = _scores(q, k, diag, scale, segs)
    m = jnp.max(s, axis=-1, keepdims=True)  # finite without segs: every row has its diagonal key
    if segs is not None:  # a query whose document starts after this key block: exp(-inf - 0) = 0
        m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=-1, keepdims=True)
    safe = jnp.where(total > 0, total, 1.0) if segs is not None else total
    pd = p if drop is None else apply_dropout(p, *drop)
    out = jnp.einsum("bhgqk,bhkd->bhgqd", pd.astype(v.dtype), v, preferred_element_type=_F32) / safe
    return out, (m + jnp.log(total))[..., 0]  # log(0) = -inf for an empty row


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
    unused: the document mask's ``(q_seg, k_seg)`` and the dropout's ``(keep, rate)``, drawn
    from the slots' global token indices (``q_pos`` per query slot, ``k_pos`` of the held block)."""
    k_segs = None if q_segs is None else _split_seq(k_seg, n, 1)
    k_poss = None if keys is None else jnp.split(k_pos, n)

    def at(qi, ki):
        segs = None if q_segs is None else (q_segs[qi], k_segs[ki])
        drop = None if keys is None else (attention_dropout_mask(keys, q_pos[qi], k_poss[ki], rate), rate)
        return segs, drop

    return at


def _forward_products(products, qs, k, v, k_seg, k_pos, acc, scale, block, masks):
    """The block products of one ring step merged into the accumulators (``block``: the CPU
    kernel's block size, or None for einsums; ``masks``: :func:`_block_masks` but for the held
    block's segment ids and token indices)."""
    ks, vs = _split_seq(k, len(qs), 2), _split_seq(v, len(qs), 2)
    at = masks(k_seg, k_pos)
    acc = list(acc)
    for qi, ki, diag in products:
        if block is None:
            b_out = _block_forward(qs[qi], ks[ki], vs[ki], diag, scale, *at(qi, ki))
        else:
            b_out = _kernel_block_forward(qs[qi], ks[ki], vs[ki], diag, scale, block)
        acc[qi] = _merge(acc[qi], b_out)
    return tuple(acc)


def _run_step(table, causal, rank, step, cp, fn, *operands):
    """Run ``fn(products, *operands)`` for ring step ``step`` (static 0 or traced): the case is
    chosen by ``lax.cond`` on the traced source rank, so the other case's products are not run."""
    if not causal:
        return fn(table["full"], *operands)
    if isinstance(step, int) and step == 0:
        return fn(table["diag"], *operands)
    return lax.cond(_below(rank, step, cp), partial(fn, table["below"]), partial(fn, table["above"]),
                    *operands)


def kv_rotation_for(pipelined: bool) -> str:
    """The :data:`KV_ROTATIONS` entry a ring inside a model should use: ``"all_gather"`` on the
    CPU backend when ``pipelined`` (the attention runs in a pipeline stage, whose collectives
    other stages do not execute in step, see the module doc), else ``"ppermute"``."""
    return "all_gather" if pipelined and jax.default_backend() == "cpu" else "ppermute"


def _gather_hop(x, axis_name: str, rank, cp: int):
    """The ``"all_gather"`` rotation: every rank gathers the cp axis's blocks and keeps rank
    ``rank - 1``'s, the block ``lax.ppermute`` would have sent it (a pytree of arrays)."""
    src = (rank - 1) % cp
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(lax.all_gather(a, axis_name), src, 0, keepdims=False), x)


def _topology(axis_name, isolated, kv_rotation):
    """The ring's size, this rank and the K/V hop to the next rank: from ``axis_name`` (by
    ``kv_rotation``), or, for ``isolated = (cp, rank)``, the given ones (``rank=None``: the rank
    from ``axis_name``) and a no-op hop."""
    if isolated is None:
        cp, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
        if kv_rotation == "all_gather":
            return cp, rank, partial(_gather_hop, axis_name=axis_name, rank=rank, cp=cp)
        perm = [(i, (i + 1) % cp) for i in range(cp)]
        return cp, rank, partial(lax.ppermute, axis_name=axis_name, perm=perm)
    cp, rank = isolated
    return cp, lax.axis_index(axis_name) if rank is None else rank, lambda x: x


def _block_size(q_chunk, k, v, seg, keys):
    """:func:`kernel_block`, or None (einsums) under the document mask or dropout: the kernel has
    no arbitrary mask (only causal or none) nor dropout; the einsum path applies both per block."""
    return None if seg is not None or keys is not None else kernel_block(q_chunk, k, v)


def _masks_and_positions(q, seg, keys, rate, rank, cp, load_balanced, n_slots):
    """This rank's :func:`_block_masks` (less the held block's ids and indices) and the function
    from a ring step to the global token indices of the K/V block then held (None without dropout)."""
    seq = cp * q.shape[3]
    q_segs = None if seg is None else _split_seq(seg, n_slots, 1)
    q_pos = None if keys is None else jnp.split(jnp.asarray(cp_positions(rank, seq, cp, load_balanced=load_balanced)),
                                                n_slots)
    masks = partial(_block_masks, q_segs=q_segs, keys=keys, q_pos=q_pos, rate=rate, n=n_slots)
    k_pos = lambda step: None if keys is None else cp_positions(_source(rank, step, cp), seq, cp,
                                                                load_balanced=load_balanced)
    return masks, k_pos


def _ring_forward(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, isolated, kv_rotation, rate):
    cp, rank, hop = _topology(axis_name, isolated, kv_rotation)
    n_slots = 2 if load_balanced else 1
    table = _SCHEDULES[(causal, load_balanced)]
    qs = _split_seq(q, n_slots, 3)
    masks, k_pos = _masks_and_positions(q, seg, keys, rate, rank, cp, load_balanced, n_slots)
    acc = tuple((jnp.zeros(x.shape, _F32), jnp.full(x.shape[:-1], -jnp.inf, _F32)) for x in qs)
    step_fn = partial(_forward_products, scale=scale, block=_block_size(qs[0], k, v, seg, keys), masks=masks)

    def compute(step, kv, acc):
        pos = k_pos(step)
        return _run_step(table, causal, rank, step, cp,
                         lambda prods, a, kk, vv, ss: step_fn(prods, qs, kk, vv, ss, pos, a), acc, *kv)

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
    out = jnp.concatenate([o for o, _ in acc], axis=3)
    lse = jnp.concatenate([lse for _, lse in acc], axis=3)
    return out, lse


def _block_backward(q, k, v, do, lse, delta, diag: bool, scale: float, segs=None, drop=None):
    """Flash attention's backward of one block, probabilities recomputed from the saved LSE (the
    ring's global one, finite: masked keys give exp(-inf) = 0). With dropout, dV reads the dropped
    probabilities and dP the kept entries; ``delta = rowsum(dO * O)`` of the dropped output is
    still ``rowsum(P * dP)``."""
    p = jnp.exp(_scores(q, k, diag, scale, segs) - lse[..., None])
    pd = p if drop is None else apply_dropout(p, *drop)
    dv = jnp.einsum("bhgqk,bhgqd->bhkd", pd.astype(do.dtype), do, preferred_element_type=_F32)
    dp = jnp.einsum("bhgqd,bhkd->bhgqk", do, v, preferred_element_type=_F32)
    dp = dp if drop is None else apply_dropout(dp, *drop)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(k.dtype), k, preferred_element_type=_F32) * scale
    dk = jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(q.dtype), q, preferred_element_type=_F32) * scale
    return dq, dk, dv


def _backward_products(products, qs, dos, outs, lses, deltas, scale, block, dq, k, v, k_seg, k_pos, masks):
    """Block gradients of one ring step: dq accumulated locally, this step's dK/dV (float32)
    returned (``block``: the CPU kernel's block size, or None for einsums; ``masks`` as in
    :func:`_forward_products`)."""
    n = len(qs)
    ks, vs = _split_seq(k, n, 2), _split_seq(v, n, 2)
    at = masks(k_seg, k_pos)
    dq = list(dq)
    dks = [jnp.zeros(x.shape, _F32) for x in ks]
    dvs = [jnp.zeros(x.shape, _F32) for x in vs]
    for qi, ki, diag in products:
        if block is None:
            g_q, g_k, g_v = _block_backward(qs[qi], ks[ki], vs[ki], dos[qi], lses[qi], deltas[qi], diag, scale,
                                            *at(qi, ki))
        else:
            g_q, g_k, g_v = _kernel_block_backward(qs[qi], ks[ki], vs[ki], dos[qi], outs[qi], lses[qi], diag,
                                                   scale, block)
        dq[qi] = dq[qi] + g_q
        dks[ki] = dks[ki] + g_k
        dvs[ki] = dvs[ki] + g_v
    return tuple(dq), jnp.concatenate(dks, axis=2), jnp.concatenate(dvs, axis=2)


def _ring_backward(q, k, v, seg, keys, out, lse, do, axis_name, causal, load_balanced, scale, isolated,
                   kv_rotation, rate):
    cp, rank, hop = _topology(axis_name, isolated, kv_rotation)
    n_slots = 2 if load_balanced else 1
    table = _SCHEDULES[(causal, load_balanced)]
    qs, dos = _split_seq(q, n_slots, 3), _split_seq(do, n_slots, 3)
    masks, k_pos = _masks_and_positions(q, seg, keys, rate, rank, cp, load_balanced, n_slots)
    block = _block_size(qs[0], k, v, seg, keys)
    if block is None:
        delta = jnp.sum(do.astype(_F32) * out.astype(_F32), axis=-1)  # rowsum(dO * O)
        outs, deltas = None, _split_seq(delta, n_slots, 3)
    else:  # the kernel computes rowsum(dO * O) itself from the global output
        outs, deltas = _split_seq(out, n_slots, 3), None
    lses = _split_seq(lse, n_slots, 3)
    step_fn = partial(_backward_products, qs=qs, dos=dos, outs=outs, lses=lses, deltas=deltas, scale=scale,
                      block=block, masks=masks)

    def compute(step, kv, dq):
        pos = k_pos(step)
        return _run_step(table, causal, rank, step, cp,
                         lambda prods, g, kk, vv, ss: step_fn(prods, dq=g, k=kk, v=vv, k_seg=ss, k_pos=pos), dq, *kv)

    kv = (k, v, seg)
    dq = tuple(jnp.zeros(x.shape, _F32) for x in qs)
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


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11))
def _ring(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, isolated, kv_rotation, rate):
    out, _ = _ring_forward(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, isolated, kv_rotation, rate)
    return out.astype(q.dtype)


def _ring_fwd(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, isolated, kv_rotation, rate):
    out, lse = _ring_forward(q, k, v, seg, keys, axis_name, causal, load_balanced, scale, isolated, kv_rotation,
                             rate)
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, keys, out, lse)


def _ring_bwd(axis_name, causal, load_balanced, scale, isolated, kv_rotation, rate, residuals, d_out):
    q, k, v, seg, keys, out, lse = residuals
    dq, dk, dv = _ring_backward(q, k, v, seg, keys, out, lse, d_out, axis_name, causal, load_balanced, scale,
                                isolated, kv_rotation, rate)
    return dq, dk, dv, None, None  # integer segment ids and PRNG keys have no cotangent


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: str = "cp", causal: bool = True,
                   load_balanced: bool = True, layout: str = "bnsd", scale: float | None = None,
                   kv_rotation: str = "ppermute", segment_ids: jax.Array | None = None,
                   dropout: tuple[jax.Array, float] | None = None,
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
                kv_rotation, rate)
    return from_grouped(out, layout)
