"""Choosing the next token from full-vocabulary logits: greedy, temperature, top-k, top-p.

Traced values (one compiled program serves every temperature, k and p); which filters run is
static (``SamplingParams``' greedy / top-k / top-p switches). Rows draw independent keys from
the seed, the step and their index in the whole batch, so a row's tokens do not depend on the
other rows, the batch size or the layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array | None,
                  top_p: jax.Array | None) -> jax.Array:
    """``[b, V]`` float32 logits divided by ``temperature``, with the tokens outside the ``top_k``
    most likely (None: no top-k; 0 also keeps all) and outside the nucleus of mass ``top_p``
    (None: none) set to ``-inf``. Top-k applies first, then top-p on what it kept (Megatron's
    and Hugging Face's order); the most likely token always survives."""
    logits = logits / temperature
    if top_k is None and top_p is None:
        return logits
    ordered = -jnp.sort(-logits, axis=-1)  # descending
    if top_k is not None:
        kth = lax.dynamic_index_in_dim(ordered, jnp.clip(top_k - 1, 0, logits.shape[-1] - 1), axis=1)  # [b, 1]
        kth = jnp.where(top_k > 0, kth, -jnp.inf)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
        ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    if top_p is not None:
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        # The cut-off logit: the smallest kept one; ties with it are kept too.
        kept = jnp.where(before < top_p, ordered, jnp.inf)
        cutoff = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def sample_tokens(logits: jax.Array, key: jax.Array, step: jax.Array, rows: jax.Array, *, greedy: bool,
                  temperature: jax.Array, top_k: jax.Array | None = None,
                  top_p: jax.Array | None = None) -> jax.Array:
    """``[b]`` int32 next tokens from ``[b, V]`` float32 logits: the argmax with ``greedy``, else
    a draw from :func:`filter_logits`' distribution with row ``rows[i]``'s key
    ``fold_in(fold_in(key, step), rows[i])``."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature, top_k, top_p)
    step_key = jax.random.fold_in(key, step)
    keys = jax.vmap(lambda r: jax.random.fold_in(step_key, r))(rows)
    return jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, filtered).astype(jnp.int32)


def token_log_probs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """``[b]`` float32 log-probabilities of ``tokens`` ``[b]`` under ``[b, V]`` logits."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


__all__ = ["filter_logits", "sample_tokens", "token_log_probs"]
