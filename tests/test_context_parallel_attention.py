"""Context-parallel attention (core/context_parallel) against plain attention on one device.

One process, 8 simulated CPU devices; meshes of the first ``cp`` devices with the single axis
``"cp"``. Global q/k/v are reordered into the load-balanced order (when asked), split over cp by
``shard_map``, the output and its q/k/v gradients computed there, and the results un-reordered.
"""

import importlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from core.context_parallel import (
    attention_dropout_mask,
    block_products,
    context_parallel_attention,
    cp_positions,
    kv_rotation_for,
    load_balance_chunk_order,
    load_balance_permutation,
    reorder_for_cp,
    restore_from_cp,
)
from core.fusions import fused_attention_available
from core.transformer.dot_product_attention import softmax_attention

# The module, not the package's re-exported ring_attention function of the same name.
blocks_module = importlib.import_module("core.context_parallel._blocks")

B, H, S, D = 2, 4, 64, 16


def _reference(q, k, v, causal=True, scale=None):
    """Plain softmax attention on [b, heads, s, d] (K/V heads repeated for GQA), float32."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("bnqd,bnkd->bnqk", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        n = q.shape[2]
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum("bnqk,bnkd->bnqd", jax.nn.softmax(s, axis=-1), v)


def _inputs(kv_heads=H, dtype=jnp.float32, seed=0, seq=S):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, H, seq, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, kv_heads, seq, D), jnp.float32)
    v = jax.random.normal(keys[2], (B, kv_heads, seq, D), jnp.float32)
    w = jax.random.normal(keys[3], (B, H, seq, D), jnp.float32)  # cotangent of the output
    return tuple(x.astype(dtype) for x in (q, k, v)) + (w,)


def _cp_fn(cp, comm_type, load_balanced, causal, layout="bnsd", check_vma=False, kv_rotation="ppermute",
           scale=None):
    """Jitted shard_map: local output and q/k/v grads of sum(out * w), all split over cp."""
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    spec = P(None, None, "cp", None) if layout == "bnsd" else P(None, "cp", None, None)
    attn = partial(context_parallel_attention, comm_type=comm_type, causal=causal,
                   load_balanced=load_balanced, layout=layout, kv_rotation=kv_rotation, scale=scale)

    def local(q, k, v, w):
        def loss(q, k, v):
            out = attn(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * w), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out, *grads)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4, check_vma=check_vma)


def _run(cp, comm_type, load_balanced, causal=True, kv_heads=H, dtype=jnp.float32, layout="bnsd", check_vma=False,
         kv_rotation="ppermute", seq=S, scale=None):
    q, k, v, w = _inputs(kv_heads, dtype, seq=seq)
    seq_axis = 2 if layout == "bnsd" else 1
    prep = (lambda x: reorder_for_cp(x, cp, seq_axis=seq_axis)) if load_balanced else (lambda x: x)
    post = (lambda x: restore_from_cp(x, cp, seq_axis=seq_axis)) if load_balanced else (lambda x: x)
    args = (q, k, v, w) if layout == "bnsd" else tuple(jnp.swapaxes(x, 1, 2) for x in (q, k, v, w))
    outs = jax.jit(_cp_fn(cp, comm_type, load_balanced, causal, layout, check_vma, kv_rotation, scale))(
        *(prep(x) for x in args))
    outs = tuple(post(x) for x in outs)
    if layout == "bsnd":
        outs = tuple(jnp.swapaxes(x, 1, 2) for x in outs)
    ref_out, vjp = jax.vjp(lambda q, k, v: _reference(q, k, v, causal, scale), q, k, v)
    return outs, (ref_out, *vjp(w))


def _assert_close(outs, refs, atol):
    for name, got, want in zip(("out", "dq", "dk", "dv"), outs, refs):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=atol, rtol=atol,
                                   err_msg=name)


@pytest.mark.parametrize("load_balanced", [True, False])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_matches_full_causal_attention(cp, comm_type, load_balanced):
    outs, refs = _run(cp, comm_type, load_balanced)
    assert outs[0].dtype == jnp.float32
    _assert_close(outs, refs, atol=1e-5)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_non_causal(comm_type):
    _assert_close(*_run(4, comm_type, True, causal=False), atol=1e-5)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_grouped_query_attention(comm_type):
    outs, refs = _run(4, comm_type, True, kv_heads=2)
    assert outs[2].shape == (B, 2, S, D)
    _assert_close(outs, refs, atol=1e-5)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_check_vma(comm_type):
    # The project's shard_maps use check_vma=False; the functions also trace under JAX's checker.
    _assert_close(*_run(2, comm_type, True, check_vma=True), atol=1e-5)


@pytest.mark.parametrize("load_balanced", [True, False])
@pytest.mark.parametrize("cp", [2, 4])
def test_all_gather_rotation_matches_full_causal_attention(cp, load_balanced):
    # The ring with each K/V hop done by an all-gather over "cp" (the CPU backend's rotation
    # inside pipeline stages): the same schedule, so the same result as plain attention.
    _assert_close(*_run(cp, "p2p", load_balanced, kv_heads=2, kv_rotation="all_gather"), atol=1e-5)


# Document starts per batch row (S = 64): inside chunks, on chunk edges at cp 4 (8, 40) and cp 2
# (32), a one-token document, a document over several chunks and ranks; row 1 has two documents.
DOC_STARTS = ((0, 5, 8, 19, 40, 41, 63), (0, 30))


def _segment_ids(seq=S):
    """``[B, seq]`` document ids (int32) from :data:`DOC_STARTS`."""
    ids = np.zeros((B, seq), np.int32)
    for row, starts in enumerate(DOC_STARTS):
        for start in starts[1:]:
            ids[row, start:] += 1
    return ids


def _cp_document_fn(cp, comm_type, kv_rotation=None, dropout_rate=0.0):
    """Jitted shard_map of load-balanced cp attention with the document mask (and dropout with
    ``[B, H]`` keys when ``dropout_rate``): local output and q/k/v grads of sum(out * w),
    everything but the keys (segment ids included) split over cp."""
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    spec, seg_spec = P(None, None, "cp", None), P(None, "cp")

    def local(q, k, v, w, seg, keys):
        def loss(q, k, v):
            out = context_parallel_attention(q, k, v, comm_type=comm_type, kv_rotation=kv_rotation or "ppermute",
                                             segment_ids=seg, dropout=(keys, dropout_rate) if dropout_rate else None)
            return jnp.sum(out * w), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out, *grads)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4 + (seg_spec, P()), out_specs=(spec,) * 4,
                       check_vma=False)
    return jax.jit(lambda q, k, v, w, seg, keys=None: fn(q, k, v, w, seg, _KEYS if keys is None else keys))


_KEYS = jax.random.split(jax.random.key(7), B * H).reshape(B, H)
"""Dropout keys, one per (sample, head)."""


def _document_run(cp, comm_type, kv_rotation=None, dropout_rate=0.0):
    """(cp outputs, reference outputs): out, dq, dk, dv of the document-masked (and dropped) cp
    attention, restored to the original order, and of ``softmax_attention`` on one device."""
    q, k, v, w = _inputs(kv_heads=2)
    seg = _segment_ids()
    prep = lambda x: reorder_for_cp(x, cp, seq_axis=2)
    fn = _cp_document_fn(cp, comm_type, kv_rotation, dropout_rate)
    outs = fn(*(prep(x) for x in (q, k, v, w)), reorder_for_cp(seg, cp))
    outs = tuple(restore_from_cp(x, cp, seq_axis=2) for x in outs)
    keep = None
    if dropout_rate:
        keep = attention_dropout_mask(_KEYS, jnp.arange(S), jnp.arange(S), dropout_rate)
    ref_out, vjp = jax.vjp(lambda q, k, v: softmax_attention(q, k, v, jnp.asarray(seg), keep, dropout_rate), q, k, v)
    return outs, (ref_out, *vjp(w))


@pytest.mark.parametrize("cp,comm_type,kv_rotation", [(2, "p2p", "ppermute"), (4, "p2p", "ppermute"),
                                                      (2, "all_gather", None), (4, "all_gather", None),
                                                      (4, "p2p", "all_gather")])
def test_document_mask_matches_full_document_causal_attention(cp, comm_type, kv_rotation):
    # --reset-attention-mask under cp: the segment ids reordered with q/k/v, the ring's K-side ids
    # rotated with K/V (blocks where a query row has no key of its document must not give NaN).
    outs, refs = _document_run(cp, comm_type, kv_rotation)
    assert all(np.isfinite(np.asarray(x)).all() for x in outs)
    _assert_close(outs, refs, atol=1e-5)
    # The mask matters: plain causal attention differs.
    q, k, v, _ = _inputs(kv_heads=2)
    assert not np.allclose(np.asarray(refs[0]), np.asarray(_reference(q, k, v)), atol=1e-3)


@pytest.mark.parametrize("cp,comm_type", [(4, "p2p"), (4, "all_gather")])
def test_dropout_matches_full_attention(cp, comm_type):
    # Attention dropout (with the document mask) drawn per global (query, key) token index: every
    # ring block and the all-gather's rows draw what one device draws for the whole matrix.
    outs, refs = _document_run(cp, comm_type, dropout_rate=0.2)
    _assert_close(outs, refs, atol=1e-5)
    assert not np.allclose(np.asarray(refs[0]), np.asarray(_document_run(1, "all_gather")[1][0]), atol=1e-3)


def test_document_mask_ring_uses_einsum_blocks():
    # The CPU kernel has only causal or no mask, so the ring's block products are einsums under
    # the document mask even where the kernel would run (128 tokens, chunks of 32 at cp 2).
    q, k, v, w = _inputs(seq=128)
    seg = jnp.zeros((B, 128), jnp.int32)
    jaxpr = str(jax.make_jaxpr(_cp_document_fn(2, "p2p"))(q, k, v, w, seg, _KEYS))
    assert "mcj_attention" not in jaxpr


@pytest.mark.skipif(not fused_attention_available(), reason="no C++ compiler: einsum block products only")
@pytest.mark.parametrize("cp,kv_heads,scale", [(2, 2, 0.3), (4, H, None)])
def test_ring_block_products_use_the_cpu_kernel(cp, kv_heads, scale, monkeypatch):
    # 128 tokens: load-balanced chunks of 32 at cp 2, of 16 (the kernel's smallest) at cp 4.
    # Diagonal blocks run the causal kernel, full ones the unmasked kernel (forward, and backward
    # with the global out/LSE); the einsum path gives the same values and grads.
    q, k, v, _ = _inputs(kv_heads, seq=128)
    assert blocks_module.kernel_block(jnp.zeros((B, kv_heads, H // kv_heads, 128 // (2 * cp), D)), k, v) == 128 // (2 * cp)
    jaxpr = str(jax.make_jaxpr(_cp_fn(cp, "p2p", True, True, scale=scale))(q, k, v, q))
    assert "mcj_attention_forward" in jaxpr and "mcj_attention_backward" in jaxpr
    outs, refs = _run(cp, "p2p", True, kv_heads=kv_heads, seq=128, scale=scale)
    _assert_close(outs, refs, atol=2e-5)
    monkeypatch.setattr(blocks_module, "fused_attention_available", lambda: False)
    assert "mcj_attention" not in str(jax.make_jaxpr(_cp_fn(cp, "p2p", True, True, scale=scale))(q, k, v, q))
    _assert_close(outs, _run(cp, "p2p", True, kv_heads=kv_heads, seq=128, scale=scale)[0], atol=2e-5)


def test_ring_kernel_only_on_cpu_float32_multiples_of_16(monkeypatch):
    q, k = jnp.zeros((1, 2, 2, 32, 16)), jnp.zeros((1, 2, 64, 16))
    assert blocks_module.kernel_block(q, k, k) in (None, 32)  # None: kernel not built here
    assert blocks_module.kernel_block(q[..., :24, :], k, k) is None
    assert blocks_module.kernel_block(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), k.astype(jnp.bfloat16)) is None
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # XLA's einsums off the CPU backend
    assert blocks_module.kernel_block(q, k, k) is None


def test_kv_rotation_is_all_gather_only_on_cpu_inside_pipeline_stages(monkeypatch):
    assert jax.default_backend() == "cpu"
    assert (kv_rotation_for(True), kv_rotation_for(False)) == ("all_gather", "ppermute")
    # Any other backend keeps the ring's ppermute (NCCL send/recv between the pair on GPU).
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert (kv_rotation_for(True), kv_rotation_for(False)) == ("ppermute", "ppermute")


def test_ring_in_diverging_pipeline_stages():
    # dp2 x pp2 x cp2 as in the pipeline executor's slot: stage 0 runs the ring's forward in one
    # lax.cond while stage 1 idles, then stage 1 runs its gradient in the next while stage 0
    # idles. XLA's CPU collective-permute rendezvouses all 8 devices (with "ppermute" this
    # program hangs and aborts); the rotation kv_rotation_for picks here rendezvouses per cp group.
    check_in_diverging_pipeline_stages(partial(context_parallel_attention, comm_type="p2p",
                                               kv_rotation=kv_rotation_for(True)), cp=2)


def check_in_diverging_pipeline_stages(attn, cp: int) -> None:
    """``attn`` (local q, k, v -> out) over a dp x pp2 x cp mesh as in the pipeline executor's slot:
    stage 0 computes the output in one ``lax.cond`` while stage 1 idles, then stage 1 the gradients
    in the next; both equal one device's (atol 1e-5)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8 // (2 * cp), 2, cp), ("dp", "pp", "cp"))

    def local(q, k, v, w):
        stage = jax.lax.axis_index("pp")
        zeros = (jnp.zeros_like(q),) * 4
        out = jax.lax.cond(stage == 0, lambda a: (attn(*a[:3]),) + zeros[1:], lambda a: zeros, (q, k, v, w))
        grads = jax.lax.cond(
            stage == 1, lambda a: (zeros[0], *jax.grad(lambda *x: jnp.sum(attn(*x) * a[3]), argnums=(0, 1, 2))(*a[:3])),
            lambda a: zeros, (q, k, v, w))
        return tuple((o + g)[None] for o, g in zip(out, grads))

    spec = P(None, None, "cp", None)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(P("pp", None, None, "cp", None),) * 4,
                       check_vma=False)
    q, k, v, w = _inputs()
    outs = jax.jit(fn)(*(reorder_for_cp(x, cp, seq_axis=2) for x in (q, k, v, w)))
    outs = [restore_from_cp(x, cp, seq_axis=3) for x in outs]
    ref_out, vjp = jax.vjp(_reference, q, k, v)
    # Stage 0 computed the output, stage 1 the gradients.
    _assert_close([outs[0][0], *(g[1] for g in outs[1:])], [ref_out, *vjp(w)], atol=1e-5)


def test_bsnd_layout():
    _assert_close(*_run(2, "p2p", True, layout="bsnd"), atol=1e-5)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_bfloat16(comm_type):
    outs, refs = _run(4, comm_type, True, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in outs)
    # bf16 inputs are the rounded float32 ones; the reference sees the same rounded values.
    _assert_close(outs, refs, atol=5e-2)


def test_block_products_balance():
    for cp in range(1, 9):
        balanced = block_products(cp, load_balanced=True)
        assert balanced == [2 * cp + 1] * cp
        assert sum(balanced) == 2 * cp * (2 * cp + 1) // 2  # causal triangle of 2cp chunks
        plain = block_products(cp, load_balanced=False)
        assert plain == list(range(1, cp + 1))  # rank r: its diagonal and r earlier chunks
        assert sum(plain) == cp * (cp + 1) // 2
        assert block_products(cp, load_balanced=True, causal=False) == [4 * cp] * cp
        assert block_products(cp, load_balanced=False, causal=False) == [cp] * cp


def test_reorder_round_trip_and_positions():
    cp, s = 4, 16
    assert load_balance_chunk_order(cp).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    x = np.arange(2 * s * 3).reshape(2, s, 3)
    y = reorder_for_cp(x, cp)
    assert isinstance(y, np.ndarray)
    np.testing.assert_array_equal(y, x[:, load_balance_permutation(s, cp)])
    np.testing.assert_array_equal(restore_from_cp(y, cp), x)
    # jnp in, jnp out, also under jit and with another sequence axis.
    xj = jnp.asarray(x).transpose(1, 0, 2)
    yj = jax.jit(lambda a: reorder_for_cp(a, cp, seq_axis=0))(xj)
    np.testing.assert_array_equal(np.asarray(yj).transpose(1, 0, 2), y)
    np.testing.assert_array_equal(np.asarray(restore_from_cp(yj, cp, seq_axis=-3)), np.asarray(xj))
    # The positions of rank r's local tokens are exactly its slice of the reordered sequence.
    positions = np.arange(s)
    for r in range(cp):
        local = reorder_for_cp(positions, cp, seq_axis=0)[r * s // cp:(r + 1) * s // cp]
        np.testing.assert_array_equal(cp_positions(r, s, cp), local)
        np.testing.assert_array_equal(cp_positions(r, s, cp, load_balanced=False), positions[r * 4:(r + 1) * 4])
    assert cp_positions(1, s, cp).tolist() == [2, 3, 12, 13]
    # Traced rank inside shard_map.
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    traced = jax.jit(jax.shard_map(lambda: cp_positions(jax.lax.axis_index("cp"), s, cp)[None], mesh=mesh,
                                   in_specs=(), out_specs=P("cp"), check_vma=False))()
    np.testing.assert_array_equal(np.asarray(traced).reshape(-1), load_balance_permutation(s, cp))


def test_bad_inputs():
    q = jnp.zeros((1, 4, 6, 8))
    with pytest.raises(ValueError, match="comm_type"):
        context_parallel_attention(q, q, q, comm_type="ulysses")
    odd = jnp.zeros((1, 4, 5, 8))
    for comm_type in ("p2p", "all_gather"):
        with pytest.raises(ValueError, match="even local sequence"):
            context_parallel_attention(odd, odd, odd, comm_type=comm_type)
    with pytest.raises(ValueError, match="layout"):
        context_parallel_attention(q, q, q, layout="sbnd")
    with pytest.raises(ValueError, match="kv_rotation"):
        context_parallel_attention(q, q, q, kv_rotation="all_to_all")
    with pytest.raises(ValueError, match="multiple of K/V heads"):
        context_parallel_attention(q, jnp.zeros((1, 3, 6, 8)), jnp.zeros((1, 3, 6, 8)))
    with pytest.raises(ValueError, match="equal local lengths"):
        context_parallel_attention(q, jnp.zeros((1, 4, 4, 8)), jnp.zeros((1, 4, 4, 8)))
    with pytest.raises(ValueError, match="does not split"):
        reorder_for_cp(np.zeros((2, 12)), 4)
    with pytest.raises(ValueError, match="does not split"):
        cp_positions(0, 12, 4)


def test_collectives_in_jaxpr():
    q, k, v, w = (reorder_for_cp(x, 4, seq_axis=2) for x in _inputs())
    ring = str(jax.make_jaxpr(_cp_fn(4, "p2p", True, True))(q, k, v, w))
    assert "ppermute" in ring and "all_gather" not in ring
    gathered_ring = str(jax.make_jaxpr(_cp_fn(4, "p2p", True, True, kv_rotation="all_gather"))(q, k, v, w))
    assert "all_gather" in gathered_ring and "ppermute" not in gathered_ring
    gather = str(jax.make_jaxpr(_cp_fn(4, "all_gather", True, True))(q, k, v, w))
    assert "all_gather" in gather and "ppermute" not in gather


def _sub_jaxprs(params):
    """Jaxprs among an equation's params (scan/cond/custom_vjp bodies), found by duck typing so the
    test does not depend on where a JAX version exports its jaxpr classes."""
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns"):
                yield item
            elif hasattr(getattr(item, "jaxpr", None), "eqns"):
                yield item.jaxpr


def _dots(jaxpr, primitive="dot_general") -> int:
    """``primitive`` equations (dot_general: einsums; ffi_call: CPU kernel calls) in ``jaxpr`` and
    every sub-jaxpr (scan bodies, cond branches)."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == primitive
        for sub in _sub_jaxprs(eqn.params):
            count += _dots(sub, primitive)
    return count


def _cond_branch_dots(jaxpr, primitive="dot_general") -> list[list[int]]:
    """Per ``cond`` equation (at any depth), the ``primitive`` count of each branch."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            found.append([_dots(b.jaxpr, primitive) for b in eqn.params["branches"]])
        for sub in _sub_jaxprs(eqn.params):
            found += _cond_branch_dots(sub, primitive)
    return found


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("load_balanced", [True, False])
def test_skipped_blocks_not_computed(load_balanced, kernel, monkeypatch):
    # The forward ring's per-step lax.cond: with load balancing both cases run two chunk products;
    # without, "below" runs one and "above" (entirely in the future) none. A product is two
    # dot_generals with einsums, one ffi_call with the CPU kernel (128 tokens: chunks of 16+).
    if kernel and not fused_attention_available():
        pytest.skip("no C++ compiler: einsum block products only")
    if not kernel:
        monkeypatch.setattr(blocks_module, "fused_attention_available", lambda: False)
    cp = 4
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    spec = P(None, None, "cp", None)
    fn = jax.shard_map(partial(context_parallel_attention, load_balanced=load_balanced), mesh=mesh,
                       in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    q, k, v, _ = _inputs(seq=128)
    per_product = 1 if kernel else 2
    branches = _cond_branch_dots(jax.make_jaxpr(fn)(q, k, v).jaxpr, "ffi_call" if kernel else "dot_general")
    want = [2 * per_product, 2 * per_product] if load_balanced else [0, per_product]
    assert branches and all(sorted(b) == want for b in branches)


def test_query_tiles():
    assert [blocks_module.query_tiles(c) for c in (64, 1024, 1025, 1536, 3000, 4096)] == [1, 1, 5, 2, 3, 4]


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_einsum_blocks_in_query_tiles_match_full_attention(comm_type, monkeypatch):
    # Einsum block products (GPU's path; here with the CPU kernel off) run their query rows in
    # tiles when a chunk is longer than QUERY_TILE: chunks of 32 at cp 2, tiles of 8 (the
    # diagonal blocks' causal mask offset per tile), forward and backward.
    monkeypatch.setattr(blocks_module, "fused_attention_available", lambda: False)
    monkeypatch.setattr(blocks_module, "QUERY_TILE", 8)
    q, k, v, _ = _inputs(kv_heads=2, seq=128)
    scores = lambda: str(jax.make_jaxpr(_cp_fn(2, comm_type, True, True))(q, k, v, q)).replace(" ", "")
    assert "f32[2,2,2,8,32]" in scores() and "f32[2,2,2,32,32]" not in scores()  # [b, h, g, tile, chunk]
    monkeypatch.setattr(blocks_module, "QUERY_TILE", 32)
    assert "f32[2,2,2,32,32]" in scores()  # untiled: [b, h, g, chunk, chunk]
    monkeypatch.setattr(blocks_module, "QUERY_TILE", 8)
    outs, refs = _run(2, comm_type, True, kv_heads=2, seq=128)
    _assert_close(outs, refs, atol=1e-5)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_query_tiles_with_document_mask_and_dropout(comm_type, monkeypatch):
    # The tiles take their rows' segment ids and global token indices (dropout's keep-mask).
    monkeypatch.setattr(blocks_module, "QUERY_TILE", 4)  # chunks of 8 at cp 4: 2 tiles
    outs, refs = _document_run(4, comm_type, dropout_rate=0.2)
    _assert_close(outs, refs, atol=1e-5)
