"""The GPT's forward for inference, inside ``shard_map`` (one pipeline stage, one model chunk, no
context or sequence parallelism): prefill of whole prompts and decode steps with a KV cache, the
plain forward of scoring, and the logits the sampler reads.

The pieces are ``GPTModel``'s own (its embedding, layers and output head). The layers' parameters
come one tree per layer, in layer order (:func:`layerwise_params`; the engine keeps them so), not
stacked: inside the decode ``while_loop`` XLA would otherwise copy each layer's slice of the
stacked weights and cache on every step. The layers run as a Python loop, each with its own cache
as the ``"cache"`` collection: prompts go through with ``prefill`` (the cache's first slots
written, causal attention over the prompt), later tokens one per row at their own positions,
reading the cache (``core.transformer.attention.ParallelAttention``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from core.models.gpt.gpt_model import expert_bias_variables
from core.parallel_state import TP_AXIS
from core.transformer.attention import KV_CACHE
from core.transformer.layer_context import LayerContext


def layer_kinds(model: Any) -> list[str]:
    """``"dense"`` or ``"moe"`` for each layer of the (one-chunk) model, in layer order."""
    return [kind for kind, _ in model.chunk_layer_slots()]


def layerwise_params(model: Any, params: dict, moe_state: dict | None = None,
                     take: Callable[[Any, int], Any] | None = None, is_leaf: Callable[[Any], bool] | None = None
                     ) -> dict:
    """``params`` with the stacked ``"layers"`` (``[1, L, ...]``, or a MoE model's ``{"dense",
    "moe"}`` stacks) as a list of each layer's flax variables in layer order: ``{"params": ...}``,
    with a MoE layer's expert bias from ``moe_state`` when given. ``take(leaf, i)`` is layer ``i``
    of a stacked leaf (default ``leaf[0, i]``: local arrays inside ``shard_map`` or global ones);
    ``is_leaf`` says what a leaf is when the stacks are other trees (specs, lists of arrays)."""
    take = take or (lambda leaf, i: leaf[0, i])
    stacks = params["layers"] if model.moe_layer is not None else {"dense": params["layers"]}
    layers = []
    for kind, i in model.chunk_layer_slots():
        variables = {"params": jax.tree.map(lambda a, i=i: take(a, i), stacks[kind], is_leaf=is_leaf)}
        if kind == "moe" and moe_state is not None:
            variables.update(expert_bias_variables(take(moe_state["expert_bias"], i)))
        layers.append(variables)
    return {**{k: v for k, v in params.items() if k != "layers"}, "layers": layers}


def run_layers(model: Any, layers: list[dict], x: jax.Array, ctx: LayerContext,
               caches: list[dict] | None = None) -> tuple[jax.Array, list[dict]]:
    """``[s, b, h]`` activations through every layer (``layers``: :func:`layerwise_params`'
    list); with ``caches`` (one per layer) each attention reads and writes its own, returned
    updated."""
    updated = []
    for j, (kind, variables) in enumerate(zip(layer_kinds(model), layers)):
        module = model.moe_layer if kind == "moe" else model.layer
        c = ctx.replace(layer_index=j)
        if caches is None:
            out = module.apply(variables, x, c)
        else:
            out, new = module.apply({**variables, KV_CACHE: caches[j]}, x, c, mutable=[KV_CACHE])
            updated.append(new[KV_CACHE])
        x = out[0] if kind == "moe" else out
    return x, updated


def forward_with_cache(model: Any, params: dict, tokens: jax.Array, positions: jax.Array, caches: list[dict],
                       prefill: bool) -> tuple[jax.Array, list[dict]]:
    """Local ``[b, s]`` tokens at ``positions`` ``[b, s]`` through the embedding and every layer
    (``params`` layerwise): ``([s, b, h] hidden states before the final norm, updated caches)``.
    ``prefill``: the tokens start their rows (positions ``0..s-1``)."""
    x = model.embed(params, {"tokens": tokens, "position_ids": positions})
    return run_layers(model, params["layers"], x, LayerContext(position_ids=positions, prefill=prefill), caches)


def forward(model: Any, params: dict, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """The plain forward (no cache) of local ``[b, s]`` tokens: ``[s, b, h]`` hidden states."""
    x = model.embed(params, {"tokens": tokens, "position_ids": positions})
    return run_layers(model, params["layers"], x, LayerContext(position_ids=positions))[0]


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


__all__ = ["forward", "forward_with_cache", "full_vocab_logits", "layer_kinds", "layerwise_params", "run_layers",
           "vocab_logits", "vocab_parallel_log_probs"]
