"""Weight initialisers of the transformer layers: Megatron's ``init_method_normal`` and the
scaled init of the layers' output projections."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from core.transformer.transformer_config import TransformerConfig


def init_method_normal(std: float) -> Callable[..., jax.Array]:
    """A normal initialiser with standard deviation ``std``, called with the global shape."""
    return lambda key, shape, dtype=jnp.float32: jax.random.normal(key, shape, dtype) * std


def output_init_std(config: TransformerConfig) -> float:
    """Megatron's scaled init of the layers' output projections: ``std / sqrt(2 * num_layers)``."""
    return config.init_method_std / (2.0 * config.num_layers) ** 0.5
