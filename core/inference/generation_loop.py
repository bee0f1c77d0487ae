"""One generation call as one compiled program (inside ``shard_map``): prefill of the prompts,
then a ``lax.while_loop`` of decode steps over a preallocated KV cache, sampling each row's next
token, until every row has stopped or the token budget is spent.

Prompts are right-padded to a common length; row ``i`` of length ``L_i`` generates its first
token from its prefill logits at position ``L_i - 1`` and writes token ``t`` at cache slot
``L_i + t - 1``. A query reads only the slots up to its own position, so nothing a row computes
depends on its padding or on other rows (slots past ``L_i`` hold padding's keys until the row's
own tokens overwrite them, and are never read before).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from core.inference.cached_forward import forward_with_cache, full_vocab_logits, vocab_logits, vocab_parallel_log_probs
from core.inference.kv_cache import allocate_kv_cache
from core.inference.sampling import sample_tokens, token_log_probs


@dataclasses.dataclass(frozen=True)
class LoopShape:
    """The static choices of one compiled generation program."""

    greedy: bool
    """Argmax instead of sampling (no key, no filters)."""
    top_k: bool
    """Whether the top-k filter runs (its k is a traced value)."""
    top_p: bool
    """Whether the nucleus filter runs (its p is a traced value)."""
    prompt_log_probs: bool
    """Also compute the prompt tokens' log-probabilities (the output head over every prompt position)."""
    new_tokens: int
    """Columns of the output buffers: the most tokens a call of this program may generate."""


def generate_local(model: Any, shape: LoopShape, params: dict, tokens: jax.Array,
                   lengths: jax.Array, rows: jax.Array, stop_ids: jax.Array, num_new: jax.Array,
                   sampling: dict) -> dict:
    """This rank's rows (``tokens`` ``[b, P]`` right-padded, ``lengths`` ``[b]``, ``rows`` their
    indices in the whole batch; ``params`` layerwise, ``cached_forward.layerwise_params``)
    generated: ``{"tokens": [b, N], "log_probs": [b, N], "lengths": [b]}``
    (``N = shape.new_tokens``; a row's tokens up to and including its first stop token, at most
    ``num_new``; zeros after), plus ``"prompt_log_probs"`` ``[b, P - 1]`` with
    ``shape.prompt_log_probs`` (entry ``j``: token ``j + 1`` given the ones before).
    ``sampling``: traced ``temperature``, ``top_k``, ``top_p`` and the ``key``."""
    b, p = tokens.shape
    n = shape.new_tokens
    cache = allocate_kv_cache(model, b, p + n, model.config.compute_dtype)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    x, cache = forward_with_cache(model, params, tokens, positions, cache, True)
    out = {}
    if shape.prompt_log_probs:
        logits = vocab_logits(model, params, x[:-1])  # [P - 1, b, V/tp]: position j predicts token j + 1
        out["prompt_log_probs"] = jnp.swapaxes(vocab_parallel_log_probs(model, logits, tokens[:, 1:].T)[0], 0, 1)
    last = jnp.take_along_axis(x, (lengths - 1)[None, :, None], axis=0)  # [1, b, h]

    def sample(logits: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
        token = sample_tokens(logits, sampling["key"], step, rows, greedy=shape.greedy,
                              temperature=sampling["temperature"], top_k=sampling["top_k"] if shape.top_k else None,
                              top_p=sampling["top_p"] if shape.top_p else None)
        return token, token_log_probs(logits, token)

    first, first_lp = sample(full_vocab_logits(model, params, last)[0], jnp.int32(0))
    done = jnp.isin(first, stop_ids)
    state = {"t": jnp.int32(1), "cache": cache, "last": first,
             "tokens": jnp.zeros((b, n), jnp.int32).at[:, 0].set(first),
             "log_probs": jnp.zeros((b, n), jnp.float32).at[:, 0].set(first_lp),
             "lengths": jnp.ones((b,), jnp.int32), "done": done, "finished": _all_finished(model, done)}

    def step(s: dict) -> dict:
        t = s["t"]
        pos = (lengths + t - 1)[:, None]  # where the previous token goes
        h, cache = forward_with_cache(model, params, s["last"][:, None], pos, s["cache"], False)
        token, lp = sample(full_vocab_logits(model, params, h)[0], t)
        live = ~s["done"]
        token, lp = jnp.where(live, token, 0), jnp.where(live, lp, 0.0)
        done = s["done"] | jnp.isin(token, stop_ids)
        return {"t": t + 1, "cache": cache, "last": token,
                "tokens": lax.dynamic_update_index_in_dim(s["tokens"], token, t, axis=1),
                "log_probs": lax.dynamic_update_index_in_dim(s["log_probs"], lp, t, axis=1),
                "lengths": s["lengths"] + live.astype(jnp.int32), "done": done,
                "finished": _all_finished(model, done)}

    state = lax.while_loop(lambda s: (s["t"] < num_new) & ~s["finished"], step, state)
    return {**out, "tokens": state["tokens"], "log_probs": state["log_probs"], "lengths": state["lengths"]}


def _all_finished(model: Any, done: jax.Array) -> jax.Array:
    """Whether every row of the whole batch has stopped: the loop's exit, the same on every rank
    (each data-parallel rank holds other rows)."""
    mine = jnp.all(done).astype(jnp.int32)
    return lax.pmin(mine, model.state.data_parallel_axis_name) > 0


__all__ = ["LoopShape", "generate_local"]
