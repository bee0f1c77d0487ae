"""GPTConfig's Llama-class options and the batch contract, against a plain single-device model.

The reference below is written independently with ``jnp`` on the global parameters (no flax,
no shard_map, no custom VJPs): a packed-QKV grouped-query transformer with RMSNorm or LayerNorm,
SwiGLU or gelu, optional biases, partial rotary or learned positions, a padded vocabulary whose
padding logits are masked, the document-causal mask and Megatron's masked loss. The parallel
model runs inside ``shard_map`` on simulated CPU devices (tp=2 with sequence parallelism;
tp=2 x pp=2 (interleaved, vpp=2) x dp=2 on 8), its grads reduced as ``finalize_model_grads``
does. Compiled programs are shared between tests (module-level caches) to keep the file short.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.distributed.finalize_model_grads import allreduce_model_parallel_grads
from core.fusions import fused_attention_available
from core.models.gpt import GPTModel
from core.models.gpt.gpt_config import GPTConfig
from core.models.gpt.gpt_layers import mask_padded_logits
from core.param_metadata import init_sharded_params
from core.pipeline_parallel.utils import split_microbatches
from core.training.train_step import mean_loss
from core.transformer.dot_product_attention import causal_attention
from core.transformer.rotary_pos_embedding import apply_rotary

S, MBS = 32, 2  # sequence (head dim 16 and seq 32: the C++ attention kernel serves unmasked batches)

LLAMA = GPTConfig(vocab_size=61, padded_vocab_size=64, num_layers=4, hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=96, seq_length=S, position_embedding_type="rope",
                  rotary_percent=0.5, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  share_embeddings_and_output_weights=False, sequence_parallel=True, layernorm_epsilon=1e-5,
                  attention_dropout=0.1, hidden_dropout=0.1)
"""Every option at once (dropout rates set: they act only on batches with ``dropout_seed``)."""

QWEN_LLAMA31 = dataclasses.replace(
    LLAMA, rotary_percent=1.0, attention_dropout=0.0, hidden_dropout=0.0, kv_channels=32,
    add_qkv_bias=True, qk_layernorm=True, rope_scaling=True, rope_scaling_original_max_position_embeddings=8,
    layernorm_epsilon=1e-6)
"""The Llama 3.1 / Qwen options together (rope scaling that matters at seq 32, heads 32 wide in a
64-wide model, a QKV bias without other biases, q/k RMSNorm) on the Llama-class ones (GQA,
SwiGLU, RMSNorm, untied output, padded vocabulary)."""

GPT = GPTConfig(vocab_size=61, padded_vocab_size=64, num_layers=2, hidden_size=64, num_attention_heads=4,
                ffn_hidden_size=96, seq_length=S, sequence_parallel=True)
"""The classic options (LayerNorm, gelu, biases, MHA, learned positions, tied) with padding."""


# -- the independent reference ---------------------------------------------------------------
def _norm(cfg, x, p):
    if cfg.normalization == "RMSNorm":
        return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.layernorm_epsilon) * p["scale"]
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + cfg.layernorm_epsilon) * p["scale"] + p["bias"]


def _dense(x, p):
    y = x @ p["weight"].T
    return y + p["bias"] if "bias" in p else y


def _llama3_scaling(cfg, inv_freq):
    """Llama 3.1's per-frequency scaling, written per frequency as Meta's reference does."""
    low_wavelen = cfg.rope_scaling_original_max_position_embeddings / cfg.rope_scaling_low_freq_factor
    high_wavelen = cfg.rope_scaling_original_max_position_embeddings / cfg.rope_scaling_high_freq_factor
    out = []
    for f in inv_freq:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / cfg.rope_scaling_factor)
        else:
            smooth = ((cfg.rope_scaling_original_max_position_embeddings / wavelen - cfg.rope_scaling_low_freq_factor)
                      / (cfg.rope_scaling_high_freq_factor - cfg.rope_scaling_low_freq_factor))
            out.append((1 - smooth) * f / cfg.rope_scaling_factor + smooth * f)
    return np.asarray(out, np.float32)


def _rope(cfg, x, pos):
    """``x`` [b, s, heads, d]: rotate the first rot dims by position (x1 cos - x2 sin, x2 cos + x1 sin)."""
    d = x.shape[-1]
    rot = int(d * cfg.rotary_percent)
    inv_freq = 1.0 / cfg.rotary_base ** (np.arange(0, rot, 2) / rot)
    if cfg.rope_scaling:
        inv_freq = _llama3_scaling(cfg, inv_freq)
    ang = pos[..., None].astype(jnp.float32) * inv_freq  # [b, s, rot/2]
    cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
    x1, x2, rest = x[..., :rot // 2], x[..., rot // 2:rot], x[..., rot:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def _layer(cfg, x, p, pos, seg):
    b, s, h = x.shape
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    d, r = cfg.kv_channels or h // heads, heads // groups
    qkv = _dense(_norm(cfg, x, p["input_layernorm"]), p["self_attention"]["linear_qkv"]).reshape(b, s, groups, r + 2, d)
    q = qkv[:, :, :, :r].reshape(b, s, heads, d)
    k, v = qkv[:, :, :, r], qkv[:, :, :, r + 1]
    if cfg.qk_layernorm:  # per head, before rotary
        q, k = _norm(cfg, q, p["self_attention"]["q_layernorm"]), _norm(cfg, k, p["self_attention"]["k_layernorm"])
    if cfg.position_embedding_type == "rope":
        q, k = _rope(cfg, q, pos), _rope(cfg, k, pos)
    k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)  # query head i reads group i // r
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(d)
    allowed = np.tril(np.ones((s, s), bool))[None, None] & (seg[:, :, None] == seg[:, None, :])[:, None]
    probs = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), -1)
    attn = jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, heads * d)
    x = x + _dense(attn, p["self_attention"]["linear_proj"])
    mlp = p["mlp"]
    y = _norm(cfg, x, mlp["layernorm"])
    if cfg.swiglu:  # fc1 weight [2, ffn, h]: gate, up
        w = mlp["fc1"]["weight"]
        bias = mlp["fc1"].get("bias", jnp.zeros(w.shape[:2]))
        a = jax.nn.silu(y @ w[0].T + bias[0]) * (y @ w[1].T + bias[1])
    else:
        a = jax.nn.gelu(_dense(y, mlp["fc1"]), approximate=True)
    return x + _dense(a, mlp["fc2"])


def reference_loss(cfg, params, batch):
    """Mean over microbatches of ``MBS`` consecutive samples of Megatron's masked token loss."""
    tokens = batch["tokens"]
    b, s = tokens.shape
    pos = batch.get("position_ids", jnp.broadcast_to(jnp.arange(s), (b, s)))
    seg = batch.get("segment_ids", jnp.zeros((b, s), jnp.int32))
    word = params["embedding"]["word_embeddings"]["weight"]
    x = word[tokens]
    if cfg.position_embedding_type == "learned_absolute":
        x = x + params["embedding"]["position_embeddings"][pos]
    layers = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), params["layers"])  # [vpp, L/vpp] -> [L]
    for i in range(cfg.num_layers):
        x = _layer(cfg, x, jax.tree.map(lambda a, i=i: a[i], layers), pos, seg)
    x = _norm(cfg, x, params["head"]["final_layernorm"])
    out = word if cfg.share_embeddings_and_output_weights else params["head"]["output_layer"]
    logits = x @ out.T
    logits = jnp.where(jnp.arange(logits.shape[-1]) < cfg.vocab_size, logits, -jnp.inf)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), batch["labels"][..., None], -1)[..., 0]
    mask = batch.get("loss_mask", jnp.ones((b, s), jnp.float32))
    nll, mask = nll.reshape(-1, MBS, s), mask.reshape(-1, MBS, s)
    return jnp.mean(jnp.sum(nll * mask, (1, 2)) / jnp.maximum(jnp.sum(mask, (1, 2)), 1.0))


@functools.cache
def _reference_step(cfg):
    with jax.default_device(jax.devices()[0]):
        return jax.jit(jax.value_and_grad(lambda p, b: reference_loss(cfg, p, b)))


def reference(cfg, params, batch):
    """(loss, grads) of :func:`reference_loss` on one device."""
    params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), params)
    loss, grads = _reference_step(cfg)(params, {k: jnp.asarray(v) for k, v in batch.items()})
    return float(loss), grads


# -- the parallel model ------------------------------------------------------------------------
@functools.cache
def _parallel(cfg, tp, pp, vpp, dp):
    """(params, jitted step(params, batch) -> (loss, grads)) of a layout; batches of ``MBS`` per microbatch."""
    state = ps.build_parallel_state(tp, pp, vpp if vpp > 1 else None, devices=jax.devices()[:tp * pp * dp])
    model = GPTModel(cfg, state)
    params, specs, infos = init_sharded_params(model.init, state.mesh,
                                               (jax.random.key(0), jnp.zeros((MBS, S), jnp.int32)), (P(), P()))
    info_leaves = jax.tree.leaves(infos)
    dp_axes = state.data_parallel_with_context_axis_name

    def body(p, batch):
        m = batch["tokens"].shape[0] // MBS
        if pp > 1:
            grads, loss, _, _ = model.forward_backward(p, batch, m)
        else:
            def add(acc, mb):
                loss, g = jax.value_and_grad(mean_loss(model.loss_fn))(p, mb)
                return jax.tree.map(lambda a, x: a + x / m, acc, (loss, g)), None

            zero = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), p))
            (loss, grads), _ = lax.scan(add, zero, split_microbatches(batch, m))
        leaves = allreduce_model_parallel_grads(jax.tree.leaves(grads), info_leaves, state)
        grads = jax.tree.unflatten(jax.tree.structure(p), [lax.pmean(g, dp_axes) for g in leaves])
        return lax.pmean(loss, dp_axes), grads

    step = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(specs, P(dp_axes)), out_specs=(P(), specs),
                                 check_vma=False))
    return params, step


def parallel(cfg, batch, tp=1, pp=1, vpp=1, dp=1):
    """(params, loss, grads) of the layout on ``batch`` (host numpy)."""
    params, step = _parallel(cfg, tp, pp, vpp, dp)
    loss, grads = step(params, batch)
    return params, float(loss), grads


# -- batches ---------------------------------------------------------------------------------
def make_batch(cfg, b, seed=0, boundaries=None, options=("loss_mask", "position_ids", "segment_ids")):
    """Random tokens/labels; two documents per sample split at ``boundaries`` (default random),
    positions restarting at each document; a loss mask with one whole microbatch masked out."""
    rng = np.random.default_rng(seed)
    batch = {"tokens": rng.integers(0, cfg.vocab_size, (b, S)).astype(np.int32),
             "labels": rng.integers(0, cfg.vocab_size, (b, S)).astype(np.int32)}
    cut = np.asarray(boundaries if boundaries is not None else rng.integers(3, S - 3, b))[:, None]
    ar = np.arange(S)[None]
    if "segment_ids" in options:
        batch["segment_ids"] = (ar >= cut).astype(np.int32)
    if "position_ids" in options:
        batch["position_ids"] = np.where(ar >= cut, ar - cut, ar).astype(np.int32)
    if "loss_mask" in options:
        mask = (rng.random((b, S)) < 0.7).astype(np.float32)
        mask[:MBS] = 0.0  # a microbatch without loss tokens: guarded denominator, zero contribution
        batch["loss_mask"] = mask
    return batch


def perturb_zero_leaves(params, seed=0):
    """``params`` with every all-zero leaf but the padding rows' (biases at init) drawn
    ``N(0, 0.02)``, keeping each leaf's sharding: a wrongly laid-out bias then shows."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [jax.device_put(0.02 * jax.random.normal(k, a.shape, a.dtype), a.sharding) if not np.any(np.asarray(a))
           else a for k, a in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, out)


def _flat_layers(tree):
    """Layer params as [L, ...] whatever the vpp stacking, as host numpy."""
    tree = jax.tree.map(np.asarray, tree)
    return {**tree, "layers": jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), tree["layers"])}


def assert_trees_close(got, want, rtol, atol_scale=1e-5):
    """Leafwise closeness (layers compared per global layer), naming the failing leaf."""
    got, want = _flat_layers(got), _flat_layers(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol_scale * max(1.0, float(np.max(np.abs(w)))),
                                   err_msg=jax.tree_util.keystr(path))


# -- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [LLAMA, GPT, QWEN_LLAMA31], ids=["llama", "gpt", "qwen-llama31"])
def test_tp2_sequence_parallel_matches_reference(cfg):
    """tp=2 + SP, every option and batch field (loss mask, positions, segments) at once; the
    LLAMA config has dropout rates but its batch no ``dropout_seed``: no dropout runs. The q/k
    norms see each tp rank's heads: their grads match only if summed over tp."""
    batch = make_batch(cfg, 4)
    params, step = _parallel(cfg, 2, 1, 1, 1)
    params = perturb_zero_leaves(params)  # biases: zero at init, compared at nonzero values
    loss, grads = step(params, batch)
    loss = float(loss)
    want_loss, want_grads = reference(cfg, params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_trees_close(grads, want_grads, rtol=1e-4)
    # Padding rows: zero at init, no gradient (their logits are masked).
    word = "output_layer" if not cfg.share_embeddings_and_output_weights else None
    rows = [np.asarray(params["embedding"]["word_embeddings"]["weight"])[cfg.vocab_size:],
            np.asarray(grads["embedding"]["word_embeddings"]["weight"])[cfg.vocab_size:]]
    if word:
        rows += [np.asarray(params["head"][word])[cfg.vocab_size:], np.asarray(grads["head"][word])[cfg.vocab_size:]]
    for r in rows:
        assert r.shape[0] == 3 and not np.any(r)


def test_llama_structure():
    """No bias leaves at all (no-bias linears, RMSNorm); GQA's fused QKV has (heads + 2 G) * d
    rows; SwiGLU's fc1 stacks gate and up; output projections use the scaled init."""
    params, _ = _parallel(LLAMA, 2, 1, 1, 1)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert not [p for p in paths if "bias" in p]
    layers = params["layers"]
    assert layers["self_attention"]["linear_qkv"]["weight"].shape == (1, 4, (4 + 2 * 2) * 16, 64)
    assert layers["mlp"]["fc1"]["weight"].shape == (1, 4, 2, 96, 64)
    assert set(layers["mlp"]["layernorm"]) == {"scale"}
    fc2 = np.asarray(layers["mlp"]["fc2"]["weight"])
    np.testing.assert_allclose(fc2.std(), 0.02 / np.sqrt(8), rtol=0.1)


def test_init_is_tensor_parallel_invariant_and_padding_only_appends():
    """The tp=2 params equal the tp=1 ones (SwiGLU gate/up and GQA groups included), and the
    padded model's real vocabulary rows equal the unpadded model's."""
    p2, _ = _parallel(LLAMA, 2, 1, 1, 1)
    p1, _ = _parallel(LLAMA, 1, 1, 1, 1)
    assert_trees_close(p2, p1, rtol=0, atol_scale=0)
    small = dataclasses.replace(LLAMA, padded_vocab_size=None)
    state1 = ps.build_parallel_state(1, devices=jax.devices()[:1])
    r, _, _ = init_sharded_params(GPTModel(small, state1).init, state1.mesh,
                                  (jax.random.key(0), jnp.zeros((MBS, S), jnp.int32)), (P(), P()))
    for path in (("embedding", "word_embeddings", "weight"), ("head", "output_layer")):
        got, want = p2, r
        for k in path:
            got, want = got[k], want[k]
        np.testing.assert_array_equal(np.asarray(got)[:61], np.asarray(want))


def test_padding_does_not_change_the_loss():
    """The padded model's loss equals the unpadded reference on its real rows (padding removed)."""
    batch = make_batch(LLAMA, 4)
    params, loss, _ = parallel(LLAMA, batch, tp=2)
    unpadded = dataclasses.replace(LLAMA, padded_vocab_size=None)
    real = jax.tree.map(np.asarray, params)
    real["embedding"]["word_embeddings"]["weight"] = real["embedding"]["word_embeddings"]["weight"][:61]
    real["head"]["output_layer"] = real["head"]["output_layer"][:61]
    np.testing.assert_allclose(loss, reference(unpadded, real, batch)[0], rtol=1e-5)


def test_padded_logits_get_zero_probability():
    state = ps.build_parallel_state(2, devices=jax.devices()[:2])
    logits = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32) * 50

    def probs(x):
        full = lax.all_gather(mask_padded_logits(x, 61), "tp", axis=1, tiled=True)
        return jax.nn.softmax(full, -1)

    got = np.asarray(jax.jit(jax.shard_map(probs, mesh=state.mesh, in_specs=P(None, "tp"), out_specs=P(),
                                           check_vma=False))(logits))
    assert not np.any(got[:, 61:])
    np.testing.assert_allclose(got[:, :61], np.asarray(jax.nn.softmax(logits[:, :61], -1)), rtol=1e-5, atol=1e-7)


def test_document_mask_equals_running_each_document_separately():
    """Two 16-token documents packed per sample (segment ids, positions restarting) give the
    loss and grads of the same documents run as 16-token samples of their own (every
    microbatch has the same token count, so both losses are the mean over all tokens)."""
    packed = make_batch(LLAMA, 4, seed=3, boundaries=np.full(4, S // 2))
    packed["loss_mask"] = np.ones_like(packed["loss_mask"])
    _, loss, grads = parallel(LLAMA, packed, tp=2)  # the compiled program of the tp=2 test
    alone = {k: packed[k].reshape(8, S // 2) for k in ("tokens", "labels", "loss_mask")}
    _, alone_loss, alone_grads = parallel(LLAMA, alone, tp=2)
    np.testing.assert_allclose(loss, alone_loss, rtol=1e-5)
    assert_trees_close(grads, alone_grads, rtol=1e-4)


def test_dropout_is_layout_invariant():
    """With ``dropout_seed`` the (tp2, SP, pp2, vpp2, dp2) loss and grads equal one device's; the
    dropout changes the loss; without seeds the same config is the deterministic reference."""
    batch = make_batch(LLAMA, 8, seed=1)
    batch["dropout_seed"] = np.arange(100, 108, dtype=np.int32)
    p1, loss1, g1 = parallel(LLAMA, batch, tp=1)
    p8, loss8, g8 = parallel(LLAMA, batch, tp=2, pp=2, vpp=2, dp=2)
    assert_trees_close(p8, p1, rtol=0, atol_scale=0)
    np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
    assert_trees_close(g8, g1, rtol=1e-4)
    no_dropout, no_dropout_grads = reference(LLAMA, p1, {k: v for k, v in batch.items() if k != "dropout_seed"})
    # A small init leaves the loss near uniform, so dropout moves it little but the grads a lot.
    assert abs(loss1 - no_dropout) > 1e-5
    for g, w in zip(jax.tree.leaves(_flat_layers(g1)), jax.tree.leaves(_flat_layers(no_dropout_grads)), strict=True):
        assert np.linalg.norm(g - w) > 0.01 * np.linalg.norm(w)


@pytest.mark.parametrize("cfg", [LLAMA, QWEN_LLAMA31], ids=["llama", "qwen-llama31"])
def test_pipeline_layout_matches_reference_without_dropout(cfg):
    """tp2 x SP x pp2 (vpp2) x dp2 on 8 devices equals the reference (no dropout_seed)."""
    batch = make_batch(cfg, 8, seed=2)
    params, step = _parallel(cfg, 2, 2, 2, 2)
    params = perturb_zero_leaves(params)
    loss, grads = step(params, batch)
    loss = float(loss)
    want_loss, want_grads = reference(cfg, params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_trees_close(grads, want_grads, rtol=1e-4)


def test_rotary_positions_and_partial_dims():
    """Explicit positions 0..s-1 equal the default; a partial rotary dim rotates only the first
    dims (as the full rotary of a head that narrow) and passes the rest through."""
    x = jax.random.normal(jax.random.key(7), (2, 3, 8, 16))  # [b, heads, s, d]
    arange = jnp.broadcast_to(jnp.arange(8), (2, 8))
    np.testing.assert_allclose(apply_rotary(x, 1e4, "bnsd", arange), apply_rotary(x, 1e4, "bnsd"), rtol=1e-6)
    half = apply_rotary(x, 1e4, "bnsd", rotary_dim=8)
    np.testing.assert_allclose(half[..., :8], apply_rotary(x[..., :8], 1e4, "bnsd"), rtol=1e-6)
    np.testing.assert_array_equal(half[..., 8:], x[..., 8:])
    shifted = jnp.broadcast_to(jnp.arange(8) + 3, (2, 8))  # bsnd with positions: the same per token
    got = apply_rotary(jnp.swapaxes(x, 1, 2), 1e4, "bsnd", shifted, rotary_dim=8)
    np.testing.assert_allclose(jnp.swapaxes(got, 1, 2), apply_rotary(x, 1e4, "bnsd", shifted, rotary_dim=8),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["blocked", "xla", "cpu_kernel"])
def test_attention_paths_with_gqa_and_segments(impl):
    """Grouped K/V heads and the document mask on every attention path equal a plain softmax."""
    if impl == "cpu_kernel" and not fused_attention_available():
        pytest.skip("no C++ compiler")
    b, heads, kv, s, d = 2, 4, 2, 32, 16
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (b, heads, s, d)) * 2
    k = jax.random.normal(keys[1], (b, kv, s, d)) * 2
    v = jax.random.normal(keys[2], (b, kv, s, d))
    seg = None if impl == "cpu_kernel" else jnp.asarray((np.arange(s)[None] >= np.array([[9], [20]])).astype(np.int32))

    def plain(q, k, v):
        kk, vv = jnp.repeat(k, heads // kv, 1), jnp.repeat(v, heads // kv, 1)
        sc = jnp.einsum("bnqd,bnkd->bnqk", q, kk) / np.sqrt(d)
        ok = np.tril(np.ones((s, s), bool))[None, None]
        if seg is not None:
            ok = ok & (seg[:, :, None] == seg[:, None, :])[:, None]
        return jnp.einsum("bnqk,bnkd->bnqd", jax.nn.softmax(jnp.where(ok, sc, -jnp.inf), -1), vv)

    def read(fn):
        loss = lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    got = read(lambda q, k, v: causal_attention(q, k, v, "bnsd", impl, segment_ids=seg))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(read(plain)), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_attention_heads=8, num_query_groups=3), "num_attention_heads 8 is not divisible by num_query_groups 3"),
    (dict(num_attention_heads=8, num_query_groups=2), "num_query_groups 2 is not divisible by "
                                                      "tensor_model_parallel_size 4"),
    (dict(vocab_size=61, padded_vocab_size=62), "padded_vocab_size 62 is not divisible by tensor_model_parallel_size 4"),
    (dict(vocab_size=61, padded_vocab_size=60), "padded_vocab_size 60 is smaller than vocab_size 61"),
    (dict(normalization="BatchNorm"), "normalization must be"),
])
def test_config_errors_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(hidden_size=64, **kwargs).validate(4, 1)


def test_flops_per_token_counts_padding_gqa_and_swiglu():
    base = GPTConfig(vocab_size=61, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96)
    h = 64
    assert dataclasses.replace(base, padded_vocab_size=64).flops_per_token() - base.flops_per_token() == 3 * 2 * h * 3
    gqa = dataclasses.replace(base, num_query_groups=2).flops_per_token()
    assert base.flops_per_token() - gqa == 3 * base.num_layers * 4 * h * 2 * 16
    glu = dataclasses.replace(base, swiglu=True).flops_per_token()
    assert glu - base.flops_per_token() == 3 * base.num_layers * 2 * h * 96
