"""Attention-probability dropout drawn per (query, key) global position, so every layout agrees.

A keep decision is ``bernoulli(fold_in(fold_in(key, q), k), 1 - rate)`` for the query at
global token index ``q`` and the key at ``k``, with one key per (sample, global head). Any
block of the ``[s, s]`` probability matrix is therefore drawn from its positions alone: one
device draws the whole matrix, a context-parallel rank the rows of its load-balanced chunks
against whichever key block it holds (ring or all-gather), and they agree exactly. The cost is
two hashes per element instead of one draw of the whole matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_dropout_mask(keys: jax.Array, q_pos: jax.Array, k_pos: jax.Array, rate: float) -> jax.Array:
    """Keep-mask ``[*keys.shape, len(q_pos), len(k_pos)]`` (bool) of the attention probabilities.

    ``keys``: typed PRNG keys, one per (sample, global head), any leading shape; ``q_pos``,
    ``k_pos``: the global token indices (not position ids) of the block's query rows and key
    columns. True keeps a probability (then scaled by ``1 / (1 - rate)``).
    """
    def one(key, q, k):
        return jax.random.bernoulli(jax.random.fold_in(jax.random.fold_in(key, q), k), 1.0 - rate)

    block = lambda key: jax.vmap(lambda q: jax.vmap(lambda k: one(key, q, k))(k_pos))(q_pos)
    flat = keys.reshape(-1)
    return jax.vmap(block)(flat).reshape(*keys.shape, q_pos.shape[0], k_pos.shape[0])


def apply_dropout(p: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    """``p`` with dropped entries zeroed and kept ones scaled by ``1 / (1 - rate)`` (``keep`` None: ``p``)."""
    return p if keep is None else jnp.where(keep, p / (1.0 - rate), 0.0)
