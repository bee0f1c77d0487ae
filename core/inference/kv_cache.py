"""The KV cache of inference: per attention layer a key and a value buffer, preallocated once per
generation call and written in place as tokens arrive.

Inside ``shard_map`` each rank holds its own heads' part: ``[b, groups / tp, T, head_dim]`` per
layer (``groups`` the key/value heads: grouped-query attention caches only those), slot ``t``
holding position ``t`` of the row. The buffers are one tree per layer (``{"self_attention":
{"key", "value"}}``, the layer's attention path), in layer order, each handed to its layer as the
``"cache"`` collection (``core.transformer.attention.KV_CACHE``): separate buffers, so a decode
step writes each in place.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from core.parallel_state import TP_AXIS


def layer_cache_shape(config: Any, batch: int, slots: int, tp: int) -> tuple[int, int, int, int]:
    """One layer's local ``[b, groups / tp, slots, head_dim]`` key (or value) buffer shape."""
    return (batch, config.query_groups // tp, slots, config.head_dim)


def allocate_kv_cache(model: Any, batch: int, slots: int, dtype: Any) -> list[dict]:
    """Zeroed local KV caches (inside ``shard_map``) of ``model`` (a ``GPTModel`` with one pipeline
    stage and one model chunk), one per layer in layer order, ``batch`` rows of ``slots``
    positions, in ``dtype``."""
    shape = layer_cache_shape(model.config, batch, slots, lax.axis_size(TP_AXIS))
    return [{"self_attention": {"key": jnp.zeros(shape, dtype), "value": jnp.zeros(shape, dtype)}}
            for _ in range(model.config.num_layers)]


def kv_cache_bytes(config: Any, batch: int, slots: int, dtype: Any) -> int:
    """Bytes of the whole model's KV cache (all ranks together) for ``batch`` rows of ``slots``."""
    per_layer = 2 * batch * config.query_groups * slots * config.head_dim * jnp.dtype(dtype).itemsize
    return per_layer * config.num_layers


__all__ = ["allocate_kv_cache", "kv_cache_bytes", "layer_cache_shape"]
