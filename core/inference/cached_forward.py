"""The GPT's forward with a KV cache, inside ``shard_map`` (one pipeline stage, one model chunk,
no context parallelism, no sequence parallelism): prefill of whole prompts, one decode step, and
the full-vocabulary logits the sampler reads.

The pieces are ``GPTModel``'s own (its embedding, layers and output head), run with each
attention layer's cache as the ``"cache"`` collection: prompts go through with ``prefill`` (the
cache's first slots written, causal attention over the prompt), later tokens one per row at their
own positions, reading the cache (``core.transformer.attention.ParallelAttention``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from core.parallel_state import TP_AXIS
from core.transformer.attention import KV_CACHE
from core.transformer.layer_context import LayerContext
from core.transformer.moe import MOE_STATE


def forward_with_cache(model: Any, params: dict, tokens: jax.Array, positions: jax.Array, cache: dict,
                       prefill: bool, moe_state: dict | None = None) -> tuple[jax.Array, dict]:
    """Local ``[b, s]`` tokens at ``positions`` ``[b, s]`` through the embedding and every layer:
    ``([s, b, h] hidden states before the final norm, updated cache)``. ``prefill``: the tokens
    start their rows (positions ``0..s-1``)."""
    x = model.embed(params, {"tokens": tokens, "position_ids": positions})
    ctx = LayerContext(position_ids=positions, prefill=prefill)
    layers = jax.tree.map(lambda a: a[0], params["layers"])  # the one model chunk
    chunk_cache = jax.tree.map(lambda a: a[0], cache)
    if model.moe_layer is None:
        x, chunk_cache = _dense_layers(model, layers, x, ctx, chunk_cache)
    else:
        bias = None if moe_state is None else moe_state["expert_bias"][0]
        x, chunk_cache = _moe_model_layers(model, layers, x, ctx, chunk_cache, bias)
    return x, jax.tree.map(lambda a: a[None], chunk_cache)


def _dense_layers(model: Any, layers: dict, x: jax.Array, ctx: LayerContext, cache: dict) -> tuple[jax.Array, dict]:
    """The stacked dense layers as a scan carrying the activations; each layer's cache goes in and
    its updated cache comes out."""
    def body(h, xs):
        p, c, index = xs
        h, updated = model.layer.apply({"params": p, KV_CACHE: c}, h, ctx.replace(layer_index=index),
                                       mutable=[KV_CACHE])
        return h, updated[KV_CACHE]

    index = jnp.arange(model.layers_per_chunk, dtype=jnp.int32)
    return lax.scan(body, x, (layers, cache, index), unroll=model.config.unroll_layers)


def _moe_model_layers(model: Any, layers: dict, x: jax.Array, ctx: LayerContext, cache: dict,
                      bias: jax.Array | None) -> tuple[jax.Array, dict]:
    """A MoE model's layers in layer order (dense and MoE stacked apart, as ``GPTModel`` runs them)."""
    count = {"dense": 0, "moe": 0}
    updated = {kind: [] for kind in cache}
    for j, is_moe in enumerate(model.chunk_moe_pattern):
        kind = "moe" if is_moe else "dense"
        i = count[kind]
        count[kind] += 1
        variables = {"params": jax.tree.map(lambda a, i=i: a[i], layers[kind]),
                     KV_CACHE: jax.tree.map(lambda a, i=i: a[i], cache[kind])}
        if is_moe and bias is not None:
            variables[MOE_STATE] = {"mlp": {"moe": {"router": {"expert_bias": bias[i]}}}}
        layer = model.moe_layer if is_moe else model.layer
        out, new = layer.apply(variables, x, ctx.replace(layer_index=j), mutable=[KV_CACHE])
        x = out[0] if is_moe else out
        updated[kind].append(new[KV_CACHE])
    stacked = {kind: jax.tree.map(lambda *a: jnp.stack(a), *caches) for kind, caches in updated.items()}
    return x, stacked


def split_layers(model: Any, params: dict, cache: dict, moe_state: dict | None = None) -> tuple[list, list]:
    """``(layers, caches)``: each layer's ``(module, variables)`` (its parameters and a MoE layer's
    expert bias) and its own cache, in layer order, sliced from the stacked ``[1, L, ...]``
    parameters and cache once. The decode loop takes these: inside a ``while_loop`` XLA
    materializes a slice of a stacked operand on every iteration, which would copy every weight
    and the whole KV cache each decode step."""
    layers = jax.tree.map(lambda a: a[0], params["layers"])
    chunk_cache = jax.tree.map(lambda a: a[0], cache)
    if model.moe_layer is None:
        n = model.layers_per_chunk
        return ([(model.layer, {"params": jax.tree.map(lambda a, i=i: a[i], layers)}) for i in range(n)],
                [jax.tree.map(lambda a, i=i: a[i], chunk_cache) for i in range(n)])
    bias = None if moe_state is None else moe_state["expert_bias"][0]
    count = {"dense": 0, "moe": 0}
    out, caches = [], []
    for is_moe in model.chunk_moe_pattern:
        kind = "moe" if is_moe else "dense"
        i = count[kind]
        count[kind] += 1
        variables = {"params": jax.tree.map(lambda a, i=i: a[i], layers[kind])}
        if is_moe and bias is not None:
            variables[MOE_STATE] = {"mlp": {"moe": {"router": {"expert_bias": bias[i]}}}}
        out.append((model.moe_layer if is_moe else model.layer, variables))
        caches.append(jax.tree.map(lambda a, i=i: a[i], chunk_cache[kind]))
    return out, caches


def decode_with_split_layers(model: Any, params: dict, layers: list, tokens: jax.Array, positions: jax.Array,
                             caches: list) -> tuple[jax.Array, list]:
    """One decode step of ``tokens`` ``[b, 1]`` at ``positions`` through :func:`split_layers`'
    layers and per-layer caches: ``([1, b, h] hidden states before the final norm, updated caches)``
    (each cache written in place)."""
    x = model.embed(params, {"tokens": tokens, "position_ids": positions})
    ctx = LayerContext(position_ids=positions, prefill=False)
    updated = []
    for j, ((layer, variables), cache) in enumerate(zip(layers, caches)):
        out, new = layer.apply({**variables, KV_CACHE: cache}, x, ctx.replace(layer_index=j), mutable=[KV_CACHE])
        x = out if layer is model.layer else out[0]
        updated.append(new[KV_CACHE])
    return x, updated


def vocab_logits(model: Any, params: dict, x: jax.Array) -> jax.Array:
    """Final norm and output layer of ``[s, b, h]`` hidden states: this rank's vocabulary-split
    ``[s, b, V/tp]`` logits (compute dtype; padding rows included)."""
    return model._output_logits(params, x)


def full_vocab_logits(model: Any, params: dict, x: jax.Array) -> jax.Array:
    """Float32 ``[s, b, vocab_size]`` logits of ``[s, b, h]`` hidden states: gathered over tp, the
    padding rows dropped (what the sampler reads; ``s`` is 1 when decoding)."""
    local = vocab_logits(model, params, x)
    full = lax.all_gather(local, TP_AXIS, axis=2, tiled=True)[..., :model.config.vocab_size]
    return full.astype(jnp.float32)


def vocab_parallel_log_probs(model: Any, logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-probabilities of ``targets`` (same leading shape as the vocabulary-split logits
    ``[..., V/tp]``) and whether each is the most likely token, without gathering the vocabulary:
    the max, the softmax's sum and the target's logit are reduced over tp. Float32; padding ids
    never count."""
    logits = logits.astype(jnp.float32)
    local = logits.shape[-1]
    first = lax.axis_index(TP_AXIS) * local
    ids = first + jnp.arange(local)
    logits = jnp.where(ids < model.config.vocab_size, logits, -jnp.inf)
    top = lax.pmax(jnp.max(logits, axis=-1), TP_AXIS)
    total = lax.psum(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1), TP_AXIS)
    mine = (targets >= first) & (targets < first + local)
    picked = jnp.take_along_axis(logits, jnp.clip(targets - first, 0, local - 1)[..., None], axis=-1)[..., 0]
    target_logit = lax.psum(jnp.where(mine, picked, 0.0), TP_AXIS)
    return target_logit - top - jnp.log(total), target_logit >= top


__all__ = ["decode_with_split_layers", "forward_with_cache", "full_vocab_logits", "split_layers", "vocab_logits",
           "vocab_parallel_log_probs"]
