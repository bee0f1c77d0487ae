"""The C++ attention kernel (XLA FFI, CPU) equals plain softmax attention, causal-masked or not:
values and gradients within fp32 rounding (1e-5); the XLA path where it does not apply."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import core.transformer.dot_product_attention as attention_module
from core.fusions import fused_attention_available, fused_causal_attention
from core.fusions.cpu_kernels import SOURCE_DIR, compile_kernel
from core.fusions.fused_attention import (
    fused_attention,
    fused_attention_backward,
    fused_attention_block,
    fused_attention_forward,
)
from core.transformer.dot_product_attention import causal_attention

needs_kernel = pytest.mark.skipif(not fused_attention_available(), reason="no C++ compiler: XLA fallback only")


def reference_attention(q, k, v, causal=True):
    """Materialised ``softmax(Q K^T / sqrt(d) (+ causal mask)) V`` over any leading dims."""
    s, d = q.shape[-2:]
    scores = jnp.einsum("...qd,...kd->...qk", q, k) / jnp.sqrt(float(d))
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(scores, axis=-1), v)


def _inputs(shape, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(key, shape) * scale for key, scale in zip(keys, (2.0, 2.0, 1.0))]


def _value_and_grads(attention, q, k, v):
    # A non-linear read-out so the output gradient differs per element.
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v))), argnums=(0, 1, 2)))(
        q, k, v)


def _assert_close(got, want):
    (got_v, got_g), (want_v, want_g) = got, want
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5, atol=1e-4)
    for g, w in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * max(1.0, float(jnp.max(jnp.abs(w)))))


@needs_kernel
@pytest.mark.parametrize("shape,block", [
    ((2, 4, 128, 64), 64),   # two query blocks of 64, the 6 x 64 micro-kernel and its 4-row tail
    ((3, 2, 48, 32), 16),    # three blocks of 16, 32-wide head: the 16-column micro-kernel
    ((1, 3, 80, 16), 16),    # five blocks, head_dim 16
    ((2, 1, 32, 48), 32),    # one block of the whole sequence
])
def test_kernel_matches_reference(shape, block):
    q, k, v = _inputs(shape)
    np.testing.assert_allclose(jax.jit(fused_causal_attention, static_argnums=3)(q, k, v, block),
                               reference_attention(q, k, v), rtol=1e-5, atol=1e-5)
    _assert_close(_value_and_grads(lambda q, k, v: fused_causal_attention(q, k, v, block), q, k, v),
                  _value_and_grads(reference_attention, q, k, v))


@needs_kernel
@pytest.mark.parametrize("shape,block", [((2, 3, 96, 32), 32), ((1, 2, 16, 16), 16)])
def test_non_causal_kernel_matches_reference(shape, block):
    q, k, v = _inputs(shape, seed=1)
    attention = lambda q, k, v: fused_attention(q, k, v, block, causal=False)
    np.testing.assert_allclose(jax.jit(attention)(q, k, v), reference_attention(q, k, v, causal=False),
                               rtol=1e-5, atol=1e-5)
    _assert_close(_value_and_grads(attention, q, k, v),
                  _value_and_grads(lambda q, k, v: reference_attention(q, k, v, causal=False), q, k, v))


@needs_kernel
@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_backward_with_the_whole_out_and_lse_sums_to_the_whole_gradients(causal):
    # Ring attention's use: queries at positions 32..63 against keys 0..63 in two blocks, the
    # earlier one unmasked, the own one ``causal`` or not. Each block's kernel backward, given the
    # whole attention's output and LSE, is that block's share: dK/dV its keys', dQ a summand.
    (q, k2, v2), (k1, v1, d_out) = _inputs((2, 2, 32, 16), seed=2), _inputs((2, 2, 32, 16), seed=3)
    kk, vv = jnp.concatenate([k1, k2], axis=-2), jnp.concatenate([v1, v2], axis=-2)
    visible = (not causal) | (jnp.arange(64)[None] <= jnp.arange(32, 64)[:, None])
    scores = lambda q, kk: jnp.where(visible, jnp.einsum("...qd,...kd->...qk", q, kk) / 4.0, -jnp.inf)
    whole = lambda q, kk, vv: jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(scores(q, kk), axis=-1), vv)
    out, vjp = jax.vjp(whole, q, kk, vv)
    lse = jax.nn.logsumexp(scores(q, kk), axis=-1)
    backward = jax.jit(fused_attention_backward, static_argnums=(6, 7))
    dq1, dk1, dv1 = backward(q, k1, v1, out, lse, d_out, 16, False)
    dq2, dk2, dv2 = backward(q, k2, v2, out, lse, d_out, 32, causal)
    want_dq, want_dk, want_dv = vjp(d_out)
    close = partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-4)
    close(dq1 + dq2, want_dq)
    close(jnp.concatenate([dk1, dk2], axis=-2), want_dk)
    close(jnp.concatenate([dv1, dv2], axis=-2), want_dv)
    # The forward's per-block LSEs combine to the whole one.
    (_, lse1), (_, lse2) = (fused_attention_forward(q, k1, v1, 16, False),
                            fused_attention_forward(q, k2, v2, 16, causal))
    close(jnp.logaddexp(lse1, lse2), lse)


@needs_kernel
def test_causal_attention_uses_the_kernel_and_the_xla_path_agrees(monkeypatch):
    q, k, v = _inputs((2, 2, 64, 32))
    assert fused_attention_block(q, k, v) == 64
    fused = _value_and_grads(causal_attention, q, k, v)
    monkeypatch.setattr(attention_module, "fused_attention_available", lambda: False)
    _assert_close(fused, _value_and_grads(causal_attention, q, k, v))


@needs_kernel
def test_deterministic_causal_and_vmapped():
    q, k, v = _inputs((2, 3, 64, 16))
    f = jax.jit(lambda q, k, v: fused_causal_attention(q, k, v, 16))
    out = f(q, k, v)
    np.testing.assert_array_equal(out, f(q, k, v))
    changed = f(q, k.at[:, :, 40:].set(7.0), v.at[:, :, 40:].set(-3.0))
    np.testing.assert_array_equal(out[:, :, :40], changed[:, :, :40])
    assert not np.allclose(out[:, :, 40:], changed[:, :, 40:])
    got = jax.vmap(lambda q, k, v: fused_causal_attention(q, k, v, 32))(q, k * 0.5, v + 1.0)
    np.testing.assert_allclose(got, reference_attention(q, k * 0.5, v + 1.0), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_nan_propagates():
    q, k, v = _inputs((1, 2, 32, 16))
    out = jax.jit(lambda q: fused_causal_attention(q, k, v, 16))(q.at[0, 1, 5, 3].set(jnp.nan))
    assert np.isnan(out[0, 1, 5]).all()
    assert np.isfinite(out[0, 0]).all() and np.isfinite(out[0, 1, :5]).all()


@needs_kernel
def test_bad_block_is_a_clear_error():
    q, k, v = _inputs((1, 1, 48, 16))
    with pytest.raises(Exception, match="block and head_dim must be multiples of 16"):
        jax.block_until_ready(jax.jit(lambda q: fused_causal_attention(q, k, v, 24))(q))


def _block(x):
    return fused_attention_block(x, x, x)


def test_shapes_the_kernel_does_not_take_fall_back():
    assert _block(jnp.zeros((1, 1, 40, 16))) is None       # s not a multiple of 16
    assert _block(jnp.zeros((1, 1, 32, 24))) is None       # head_dim not a multiple of 16
    assert _block(jnp.zeros((1, 1, 32, 16), jnp.bfloat16)) is None
    assert _block(jnp.zeros((1, 1, 96, 16))) == 48
    q, k, v = _inputs((2, 2, 40, 16))
    _assert_close(_value_and_grads(causal_attention, q, k, v), _value_and_grads(reference_attention, q, k, v))


def test_compile_failure_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="compiling attention_cpu.cc failed"):
        compile_kernel(SOURCE_DIR / "attention_cpu.cc", tmp_path / "k.so")
    assert not list(tmp_path.iterdir())


def test_layout_tests_exercise_the_kernel():
    """The pretraining layout tests' model must take the fused path (head dim and seq multiples of 16)."""
    from pretrain_harness import TINY

    flag = lambda name: int(TINY[TINY.index(name) + 1])
    head_dim = flag("--hidden-size") // flag("--num-attention-heads")
    assert _block(jnp.zeros((1, 1, flag("--seq-length"), head_dim))) is not None
