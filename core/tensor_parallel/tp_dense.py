"""Tensor-parallel dense layers with the xlstm_jax API: ``TPDense``, ``TPAsyncDense``,
``ModelParallelismWrapper``, ``scale_init``.

Parameters of a wrapped module get a leading model-axis dimension (local size 1, partition
name = the model axis), so every tp rank holds its own, differently initialised shard. The
gather/scatter communication goes through the package's paired mappings
(:func:`all_gather_last_dim_from_tensor_parallel_region`: forward all-gather, backward
reduce-scatter; and its reverse), which use the backend-aware reduce-scatter, so the
backward pass never issues a gloo reduce-scatter on CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core.frozen_dict import FrozenDict
from jax import lax

from core.distributed.array_utils import stack_params, unstack_params
from core.tensor_parallel.async_collectives import (
    async_gather,
    async_gather_bidirectional,
    async_scatter,
    async_scatter_split,
)
from core.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
)

TPMode = Literal["scatter", "gather", "none"]
_NO_KWARGS = FrozenDict({})


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


def _unstack_wrapped_params(params: Any, axis_name: str) -> Any:
    """The wrapper's own inverse of :func:`stack_params`.

    Boxed params are unstacked by their names. Params passed unboxed (metadata stripped, e.g.
    by ``core.param_metadata.unbox``) lose the names, so their leading size-1 dimension, which
    the wrapper's ``stack_params`` always adds at position 0, is removed; arrays without it
    (the wrapped module's raw params while flax initialises it) pass unchanged. A raw param
    with a leading size-1 dim would be squeezed and fail flax's shape check loudly, never
    silently.
    """
    params = unstack_params(params, axis_name)
    squeeze = lambda x: jnp.squeeze(x, 0) if not _is_box(x) and jnp.ndim(x) and x.shape[0] == 1 else x
    return jax.tree.map(squeeze, params, is_leaf=_is_box)


def scale_init(init_fn: Callable, scale_factor: float = 1.0) -> Callable:
    """An initializer returning ``scale_factor * init_fn(...)``."""

    def init(rng, *args, **kwargs):
        return scale_factor * init_fn(rng, *args, **kwargs)

    return init


class ModelParallelismWrapper(nn.Module):
    """Give a module a separate parameter shard on every rank of ``model_axis_name``."""

    model_axis_name: str
    """Mesh axis the parameters are sharded over."""
    module_fn: Callable[..., nn.Module]
    """Constructor of the wrapped module (called with ``name`` and ``module_kwargs``)."""
    mask_except_model_idx: int | None = None
    """If set, parameters are zero except on this model-axis rank."""
    split_rngs: bool = True
    """Initialise each rank's shard from a different key (folded with the rank)."""
    module_kwargs: FrozenDict = _NO_KWARGS
    """Extra keyword arguments for ``module_fn``."""

    @nn.compact
    def __call__(self, *args, **kwargs):
        """Apply the wrapped module with this rank's parameter shard."""
        if self.is_initializing() and self.split_rngs:
            rngs = self.scope.rngs["params"]
            self.scope.rngs["params"] = rngs.replace(
                rng=jax.random.fold_in(rngs.rng, lax.axis_index(self.model_axis_name)))
        module = nn.map_variables(
            target=functools.partial(self.module_fn, name="sharded", **self.module_kwargs),
            trans_in_fn=functools.partial(_unstack_wrapped_params, axis_name=self.model_axis_name),
            trans_out_fn=functools.partial(stack_params, axis_name=self.model_axis_name,
                                           mask_except=self.mask_except_model_idx),
            mapped_collections="params",
            mutable=True,
        )()
        return module(*args, **kwargs)


def _bias_kwargs(use_bias: bool) -> dict:
    """``dense_fn``'s bias keyword: passed only to turn the bias off, so a ``dense_fn`` without a
    ``use_bias`` argument keeps working with the default."""
    return {} if use_bias else {"use_bias": False}


def _sharded_dense(layer, kernel_init, name, module_kwargs=_NO_KWARGS):
    return ModelParallelismWrapper(
        model_axis_name=layer.model_axis_name,
        module_fn=functools.partial(layer.dense_fn, kernel_init=scale_init(kernel_init, layer.kernel_init_adjustment)),
        module_kwargs=module_kwargs, name=name)


class TPDense(nn.Module):
    """Dense layer with tensor parallelism: ``gather`` the input features or ``scatter`` the output."""

    dense_fn: Any
    """Constructor of the dense layer (must accept ``kernel_init``), e.g. ``partial(nn.Dense, features=...)``."""
    model_axis_name: str
    """Tensor-parallel mesh axis."""
    tp_mode: TPMode = "none"
    """``gather``: all-gather input features, local dense; ``scatter``: local dense, reduce-scatter output."""
    skip_communication: bool = False
    """Skip the gather/scatter (input already gathered, or the caller communicates)."""
    kernel_init: Callable = nn.initializers.lecun_normal()
    """Kernel initializer."""
    kernel_init_adjustment: float = 1.0
    """Factor applied to the kernel initializer."""
    dense_name: str = "module"
    """Name of the wrapped dense module."""
    use_bias: bool = True
    """Whether the dense layers have a bias (``False`` is passed on to ``dense_fn`` as ``use_bias``)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the layer."""
        mode = self.tp_mode if lax.axis_size(self.model_axis_name) > 1 else "none"
        bias = _bias_kwargs(self.use_bias)
        if mode == "none":
            return self.dense_fn(kernel_init=self.kernel_init, **bias)(x)
        if mode == "gather":
            if not self.skip_communication:
                x = all_gather_last_dim_from_tensor_parallel_region(x, self.model_axis_name)
            return _sharded_dense(self, self.kernel_init, self.dense_name, FrozenDict(bias))(x)
        if mode == "scatter":
            y = _sharded_dense(self, self.kernel_init, self.dense_name, FrozenDict(bias))(x)
            if not self.skip_communication:
                y = reduce_scatter_last_dim_to_tensor_parallel_region(y, self.model_axis_name)
            return y
        raise ValueError(f"unknown tp_mode {self.tp_mode!r}")


class TPAsyncDense(nn.Module):
    """Tensor-parallel dense that overlaps ring communication with per-chunk matmuls."""

    dense_fn: Any
    """Constructor of the dense layer (must accept ``kernel_init`` and ``use_bias``)."""
    model_axis_name: str
    """Tensor-parallel mesh axis."""
    tp_mode: TPMode = "none"
    """``gather``: one dense per gathered input chunk, summed; ``scatter``: one dense per destination, ring-summed."""
    kernel_init: Callable = nn.initializers.lecun_normal()
    """Kernel initializer."""
    kernel_init_adjustment: float = 1.0
    """Factor applied to the kernel initializer."""
    dense_name: str = "module"
    """Unused name kept for API compatibility (shards are named ``shard_i``)."""
    use_bidirectional_gather: bool = True
    """Gather both ways round the ring."""
    use_bidirectional_scatter: bool = False
    """Scatter with the features split over both ring directions."""
    use_bias: bool = True
    """Whether the layer has a bias: on the first chunk's dense only (the chunks are summed)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the layer."""
        n = lax.axis_size(self.model_axis_name)
        mode = self.tp_mode if n > 1 else "none"
        if mode == "none":
            return self.dense_fn(kernel_init=self.kernel_init, name="shard_0", **_bias_kwargs(self.use_bias))(x)
        bias = lambda i: FrozenDict({"use_bias": self.use_bias and i == 0})
        shard = lambda i: _sharded_dense(self, self.kernel_init, f"shard_{i}", bias(i))
        if mode == "gather":
            gather = async_gather_bidirectional if self.use_bidirectional_gather else async_gather
            ys = [shard(i)(chunk) for i, chunk in enumerate(gather(x, self.model_axis_name))]
            return jax.tree.map(lambda *parts: sum(parts), *ys)
        if mode == "scatter":
            ys = [shard(i)(x) for i in range(n)]
            scatter = async_scatter_split if self.use_bidirectional_scatter else async_scatter
            return scatter(ys, self.model_axis_name)
        raise ValueError(f"unknown tp_mode {self.tp_mode!r}")
