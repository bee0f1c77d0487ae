"""Attention-probability dropout drawn per (query, key) global position, so every layout agrees.

A keep decision is a 32-bit integer hash of the query's global token index ``q``, the key's
``k`` and a seed per (sample, global head) taken from that head's PRNG key, compared with
``(1 - rate) * 2**32``. Any block of the ``[s, s]`` probability matrix is therefore drawn from its
positions alone: one device draws the whole matrix, a context-parallel rank the rows of its
load-balanced chunks against whichever key block it holds (ring or all-gather), and they agree
exactly. The hash (Wellons' "lowbias32" mixer, two rounds per element) costs a few integer
operations per element, less than a threefry draw of the whole matrix (one
``fold_in``/``bernoulli`` per element would cost three threefry hashes each).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _mix(x: jax.Array) -> jax.Array:
    """Wellons' lowbias32: a bijective uint32 hash whose output bits each depend on every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


_GOLDEN = 0x9E3779B9
"""Spreads consecutive indices over the whole 32-bit range (a Python int: a jnp constant at import
would start JAX's backend before the launcher sets the CPU device count)."""


def attention_dropout_mask(keys: jax.Array, q_pos: jax.Array, k_pos: jax.Array, rate: float) -> jax.Array:
    """Keep-mask ``[*keys.shape, len(q_pos), len(k_pos)]`` (bool) of the attention probabilities.

    ``keys``: typed PRNG keys, one per (sample, global head), any leading shape; ``q_pos``,
    ``k_pos``: the global token indices (not position ids) of the block's query rows and key
    columns. True keeps a probability (then scaled by ``1 / (1 - rate)``).
    """
    data = jax.random.key_data(keys).astype(jnp.uint32)
    seed = jnp.zeros(keys.shape, jnp.uint32)
    for i in range(data.shape[-1]):  # every word of the key (2 for threefry)
        seed = _mix(seed ^ data[..., i])
    rows = _mix(seed[..., None] ^ (q_pos.astype(jnp.uint32) * jnp.uint32(_GOLDEN)))  # [..., Q]
    bits = _mix(rows[..., :, None] + k_pos.astype(jnp.uint32) * jnp.uint32(_GOLDEN))  # [..., Q, K]
    threshold = min(int(round((1.0 - rate) * 2.0**32)), 2**32 - 1)
    return bits < jnp.uint32(threshold)


def apply_dropout(p: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    """``p`` with dropped entries zeroed and kept ones scaled by ``1 / (1 - rate)`` (``keep`` None: ``p``)."""
    return p if keep is None else jnp.where(keep, p / (1.0 - rate), 0.0)
