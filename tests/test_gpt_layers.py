"""GPT building blocks: hand-written VJPs equal autodiff of the plain expressions."""

import jax
import jax.numpy as jnp
import numpy as np

from core.models.gpt.gpt_layers import split_qkv


def test_split_qkv_value_and_gradient_equal_autodiff():
    """``split_qkv`` ([s, b, heads, 3, d] -> three [b, heads, s, d]) and its VJP equal the plain
    transpose-and-unstack under autodiff."""
    s, b, heads, d = 6, 2, 3, 4
    qkv = jax.random.normal(jax.random.key(0), (s, b, heads, 3, d))
    cots = tuple(jax.random.normal(k, (b, heads, s, d)) for k in jax.random.split(jax.random.key(1), 3))
    ref = lambda x: tuple(jnp.transpose(x, (3, 1, 2, 0, 4)))
    for got, want in zip(split_qkv(qkv), ref(qkv), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    got, want = (jax.jit(lambda c, f=f: jax.vjp(f, qkv)[1](c)[0])(cots) for f in (split_qkv, ref))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
