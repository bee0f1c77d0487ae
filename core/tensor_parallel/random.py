"""Model-parallel vs data-parallel RNG streams and tensor-parallel-invariant initialization.

Megatron keeps a default CUDA RNG (identical across tp ranks: dropout outside tensor-parallel
regions) and a ``'model-parallel-rng'`` stream offset by the tp rank (dropout inside tp
regions, and per-shard init on GPU). With JAX's explicit keys both are pure functions:

* :func:`data_parallel_rng` — the key as is: identical on every tp rank (e.g. dropout on
  replicated or sequence-gathered activations must match across tp);
* :func:`model_parallel_rng` — the key folded with the tp rank: differs across tp ranks (dropout
  on tp-split activations, attention heads).

Initialisation does *not* use the model-parallel stream: :func:`tensor_parallel_init` draws the
full (global-shape) weight from the same key on every tp rank and keeps this rank's slice, so a
weight initialised at tp=k equals the tp=1 weight split k ways (Megatron's
``use_cpu_initialization`` behaviour) and results do not depend on the layout.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax

from core.parallel_state import TP_AXIS

MODEL_PARALLEL_RNG_OFFSET = 2718  # Megatron's seed offset of the model-parallel stream


def model_parallel_rng(key: jax.Array, axis_name: str = TP_AXIS) -> jax.Array:
    """A key that differs across tensor-parallel ranks (inside ``shard_map``)."""
    return jax.random.fold_in(jax.random.fold_in(key, MODEL_PARALLEL_RNG_OFFSET), lax.axis_index(axis_name))


def data_parallel_rng(key: jax.Array) -> jax.Array:
    """The key shared by all tensor-parallel ranks (Megatron's default RNG)."""
    return key


def tensor_parallel_init(init_fn: Callable, partition_dim: int, axis_name: str = TP_AXIS) -> Callable:
    """Wrap a flax initializer ``init_fn(key, shape, dtype)`` to be tensor-parallel invariant.

    Called with the *local* shape inside ``shard_map``, it initialises the global shape (local
    size x tp along ``partition_dim``) from ``key`` and returns this rank's slice.
    """

    def init(key, shape, dtype=jax.numpy.float32):
        n = lax.axis_size(axis_name)
        full = list(shape)
        full[partition_dim] *= n
        value = init_fn(key, tuple(full), dtype)
        size = shape[partition_dim]
        return lax.dynamic_slice_in_dim(value, lax.axis_index(axis_name) * size, size, axis=partition_dim)

    return init


def sequence_parallel_dropout(key: jax.Array, x: jax.Array, rate: float, sequence_parallel: bool,
                              axis_name: str = TP_AXIS) -> jax.Array:
    """Dropout on ``[s, b, h]`` activations that is the same whatever the tp layout.

    The keep-mask is drawn for the *full* sequence from ``key`` (identical on every tp rank, the
    data-parallel stream); under sequence parallelism each rank keeps its own sequence slice, so
    every token gets the mask it would get at tp=1. (Megatron forks the model-parallel RNG here,
    which makes masks, and results, depend on the layout.)
    """
    if rate == 0.0:
        return x
    if not 0.0 < rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    n = lax.axis_size(axis_name) if sequence_parallel else 1
    full = (x.shape[0] * n,) + x.shape[1:]
    keep = jax.random.bernoulli(data_parallel_rng(key), 1.0 - rate, full)
    if sequence_parallel:
        keep = lax.dynamic_slice_in_dim(keep, lax.axis_index(axis_name) * x.shape[0], x.shape[0], axis=0)
    return jax.numpy.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)
