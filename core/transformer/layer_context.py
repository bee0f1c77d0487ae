"""What a transformer layer reads besides its activations, and the layout-invariant dropout.

:class:`LayerContext` carries a microbatch's optional entries to the layers: ``"position_ids"``
``[b, s]`` int32 (absent: ``arange(s)``; read by learned positions and rotary),
``"segment_ids"`` ``[b, s]`` int32 (document-causal attention: a token sees earlier-or-same
positions of its own segment) and ``"dropout_seed"`` ``[b]`` int32 (training batches with
dropout: without it no dropout runs), plus the global index of the layer being run.

Dropout masks do not depend on the layout: sample ``i``'s key is ``fold_in(key(0),
dropout_seed[i])``, then the global layer index and a per-site tag are folded in, the mask is
drawn at the sample's global shape (``[s, h]`` for hidden dropout; ``[s, s]`` per global head
index for attention dropout, ``core.transformer.attention``) and each rank keeps what it holds
(its sequence shard under sequence parallelism, its heads under tp).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from core.context_parallel import cp_positions
from core.parallel_state import CP_AXIS, TP_AXIS


@flax.struct.dataclass
class LayerContext:
    """What the layers read from the microbatch besides the activations (see module docstring)."""

    position_ids: jax.Array | None = None
    """``[b, s]`` positions (None: ``arange(s)``)."""
    segment_ids: jax.Array | None = None
    """``[b, s]`` document ids for the document-causal mask (None: plain causal)."""
    dropout_seed: jax.Array | None = None
    """``[b]`` per-sample dropout seeds (None: no dropout)."""
    layer_index: Any = 0
    """Global index of the layer being run (folded into its dropout keys)."""
    prefill: bool = flax.struct.field(pytree_node=False, default=False)
    """Inference with a KV cache (``core.inference``): the new tokens start every row's sequence
    (positions ``0..s-1``), so attention runs over them alone and writes the cache's first ``s``
    slots. False with a cache: the tokens continue the cached sequences at ``position_ids``."""

    @classmethod
    def from_batch(cls, batch: Any, layer_index: Any = 0) -> LayerContext:
        """The context of a microbatch dict (anything else, e.g. bare tokens, has no options)."""
        if not isinstance(batch, dict):
            return cls(layer_index=layer_index)
        return cls(batch.get("position_ids"), batch.get("segment_ids"), batch.get("dropout_seed"), layer_index)


# Dropout sites (folded into each sample's key after the layer index).
DROPOUT_EMBEDDING, DROPOUT_ATTENTION_PROBS, DROPOUT_ATTENTION_OUTPUT, DROPOUT_MLP_OUTPUT = range(4)


def dropout_keys(dropout_seed: jax.Array, layer_index: Any, site: int) -> jax.Array:
    """``[b]`` keys of one dropout site: ``fold_in(fold_in(fold_in(key(0), seed_i), layer), site)``."""
    base = jax.random.key(0)
    one = lambda seed: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, seed), layer_index), site)
    return jax.vmap(one)(dropout_seed)


def hidden_dropout(x: jax.Array, ctx: LayerContext | None, rate: float, site: int,
                   sequence_parallel: bool, context_parallel_size: int = 1) -> jax.Array:
    """Dropout on ``[s(/tp/cp), b, h]`` activations with each sample's ``[s, h]`` mask, drawn at
    the full sequence length and cut to the rows this rank holds (its sequence-parallel shard of
    its context-parallel chunks), so the mask of a token does not depend on the layout; the
    identity without a rate or a ``dropout_seed``."""
    if rate == 0.0 or ctx is None or ctx.dropout_seed is None:
        return x
    s_local, _, h = x.shape
    tp = lax.axis_size(TP_AXIS) if sequence_parallel else 1
    s_full = s_local * tp * context_parallel_size
    keys = dropout_keys(ctx.dropout_seed, ctx.layer_index, site)
    keep = jnp.swapaxes(jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, (s_full, h)))(keys), 0, 1)
    start = lax.axis_index(TP_AXIS) * s_local if sequence_parallel else 0
    if context_parallel_size > 1:  # the load-balanced chunks' global rows, then this tp rank's part
        rows = cp_positions(lax.axis_index(CP_AXIS), s_full, context_parallel_size)
        keep = jnp.take(keep, lax.dynamic_slice_in_dim(rows, start, s_local), axis=0)
    elif sequence_parallel:
        keep = lax.dynamic_slice_in_dim(keep, start, s_local, axis=0)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)
