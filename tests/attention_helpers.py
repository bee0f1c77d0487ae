"""Shared by the attention tests (CPU dispatch and the GPU set): inputs, value-and-grads, closeness."""

import jax
import jax.numpy as jnp
import numpy as np


def qkv(shape, dtype=jnp.float32, seed=3, qk_scale=2.0):
    """Random q, k, v of ``shape``; q and k scaled by ``qk_scale`` (2: a softmax that is not flat)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    return [(jax.random.normal(k, shape) * s).astype(dtype) for k, s in zip(keys, (qk_scale, qk_scale, 1.0))]


def value_and_grads(fn, q, k, v):
    """Jitted value and (q, k, v) gradients of a non-linear read-out of ``fn(q, k, v)``."""
    loss = lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v).astype(jnp.float32)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def assert_close(got, want, tol):
    """Every leaf within ``tol`` relative, and ``tol`` times the leaf's largest magnitude absolute."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * max(1.0, float(np.max(np.abs(w)))))
