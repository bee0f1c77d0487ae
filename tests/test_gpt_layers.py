"""GPT building blocks: hand-written VJPs equal autodiff of the plain expressions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.models.gpt.gpt_layers import apply_rotary, split_qkv


@pytest.mark.parametrize("layout,perm", [("bnsd", (3, 1, 2, 0, 4)), ("bsnd", (3, 1, 0, 2, 4))])
def test_split_qkv_value_and_gradient_equal_autodiff(layout, perm):
    """``split_qkv`` ([s, b, heads, 3, d] -> three [b, heads, s, d] or [b, s, heads, d]) and its
    VJP equal the plain transpose-and-unstack under autodiff."""
    s, b, heads, d = 6, 2, 3, 4
    qkv = jax.random.normal(jax.random.key(0), (s, b, heads, 3, d))
    ref = lambda x: tuple(jnp.transpose(x, perm))
    split = lambda x: split_qkv(x, layout)
    shape = ref(qkv)[0].shape
    cots = tuple(jax.random.normal(k, shape) for k in jax.random.split(jax.random.key(1), 3))
    for got, want in zip(split(qkv), ref(qkv), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    got, want = (jax.jit(lambda c, f=f: jax.vjp(f, qkv)[1](c)[0])(cots) for f in (split, ref))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_rotary_is_the_same_in_both_layouts():
    x = jax.random.normal(jax.random.key(2), (2, 3, 8, 4))  # [b, heads, s, d]
    bnsd = apply_rotary(x, 10000.0, "bnsd")
    bsnd = apply_rotary(jnp.swapaxes(x, 1, 2), 10000.0, "bsnd")
    np.testing.assert_allclose(np.asarray(jnp.swapaxes(bsnd, 1, 2)), np.asarray(bnsd), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(bnsd[:, :, 0]), np.asarray(x[:, :, 0]))  # position 0: no rotation
