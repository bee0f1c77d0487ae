"""The blocked flash-style causal attention equals plain masked softmax attention (fp32, 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.transformer.blocked_attention import blocked_causal_attention as causal_attention


def reference_attention(q, k, v):
    """Materialised ``softmax(Q K^T / sqrt(d) + causal mask) V``."""
    s, d = q.shape[-2], q.shape[-1]
    scores = jnp.einsum("bnqd,bnkd->bnqk", q, k) / jnp.sqrt(float(d))
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    return jnp.einsum("bnqk,bnkd->bnqd", jax.nn.softmax(scores, axis=-1), v)


def _inputs(b, n, s, d):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(key, (b, n, s, d)) for key in keys]


def _loss(attention, **kw):
    # A non-linear read-out so the output gradient differs per element.
    return lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v, **kw)))


@pytest.mark.parametrize("shape,block_size,chunk", [
    ((2, 4, 32, 8), 8, 8),   # several query blocks, chunks of 8 (batch x head) rows
    ((3, 2, 32, 8), 8, 4),   # chunk 4 does not divide 6 rows: falls back to 3
    ((2, 2, 24, 8), 16, 2),  # block does not divide s: one block
    ((1, 1, 16, 4), 64, 8),  # block larger than s
])
def test_matches_reference_output_and_grads(shape, block_size, chunk):
    q, k, v = _inputs(*shape)
    np.testing.assert_allclose(causal_attention(q, k, v, block_size, chunk), reference_attention(q, k, v),
                               rtol=1e-5, atol=1e-5)
    grads = jax.grad(_loss(causal_attention, block_size=block_size, chunk=chunk), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(_loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_is_causal():
    q, k, v = _inputs(1, 2, 16, 4)
    out = causal_attention(q, k, v, block_size=4)
    changed = causal_attention(q, k.at[:, :, 10:].set(7.0), v.at[:, :, 10:].set(-3.0), block_size=4)
    np.testing.assert_array_equal(out[:, :, :10], changed[:, :, :10])
    assert not np.allclose(out[:, :, 10:], changed[:, :, 10:])


def test_bf16_inputs_keep_dtype():
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(1, 2, 16, 8))
    grads = jax.grad(lambda q, k, v: jnp.sum(causal_attention(q, k, v, 4).astype(jnp.float32)), argnums=(0, 1, 2))(
        q, k, v)
    assert causal_attention(q, k, v, 4).dtype == jnp.bfloat16
    assert all(g.dtype == jnp.bfloat16 for g in grads)
    np.testing.assert_allclose(causal_attention(q, k, v, 4).astype(jnp.float32),
                               reference_attention(*(x.astype(jnp.float32) for x in (q, k, v))), atol=3e-2)
