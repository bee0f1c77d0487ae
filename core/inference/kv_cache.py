"""The KV cache of inference: per attention layer a key and a value buffer, preallocated once per
generation call and written in place as tokens arrive.

Inside ``shard_map`` each rank holds its own heads' part: ``[b, groups / tp, T, head_dim]`` per
layer (``groups`` the key/value heads: grouped-query attention caches only those), slot ``t``
holding position ``t`` of the row. The buffers are stacked like the layers' parameters
(``GPTModel``: ``[1, L, ...]``; a MoE model's ``{"dense": [1, n_dense, ...], "moe": [1, n_moe,
...]}``), under each layer's attention path (``{"self_attention": {"key", "value"}}``), so a scan
over the stacked layers hands every layer its own cache as the ``"cache"`` collection
(``core.transformer.attention.KV_CACHE``).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from core.parallel_state import TP_AXIS


def layer_cache_shape(config: Any, batch: int, slots: int, tp: int) -> tuple[int, int, int, int]:
    """One layer's local ``[b, groups / tp, slots, head_dim]`` key (or value) buffer shape."""
    return (batch, config.query_groups // tp, slots, config.head_dim)


def allocate_kv_cache(model: Any, batch: int, slots: int, dtype: Any) -> dict:
    """Zeroed local KV cache (inside ``shard_map``) for ``model`` (a ``GPTModel`` with one pipeline
    stage and one model chunk), ``batch`` rows of ``slots`` positions, in ``dtype``."""
    shape = layer_cache_shape(model.config, batch, slots, lax.axis_size(TP_AXIS))

    def stack(n: int) -> dict:
        zeros = jnp.zeros((1, n) + shape, dtype)
        return {"self_attention": {"key": zeros, "value": zeros}}

    if model.moe_layer is None:
        return stack(model.layers_per_chunk)
    n_moe = sum(model.chunk_moe_pattern)
    kinds = {"dense": model.layers_per_chunk - n_moe, "moe": n_moe}
    return {kind: stack(n) for kind, n in kinds.items() if n}


def kv_cache_bytes(config: Any, batch: int, slots: int, dtype: Any) -> int:
    """Bytes of the whole model's KV cache (all ranks together) for ``batch`` rows of ``slots``."""
    per_layer = 2 * batch * config.query_groups * slots * config.head_dim * jnp.dtype(dtype).itemsize
    return per_layer * config.num_layers


__all__ = ["allocate_kv_cache", "kv_cache_bytes", "layer_cache_shape"]
