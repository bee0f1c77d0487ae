"""FSDP utilities with the xlstm_jax API: shard parameters over a data axis, gather them for use.

Same names and semantics as ``xlstm_jax.distributed.data_parallel`` (from the JAX scaling
tutorials), for code inside ``jax.shard_map``:

* :func:`shard_params` splits every parameter larger than ``min_weight_size`` along its
  largest dimension divisible by the axis size and records the axis in the box's ``names``;
* :func:`gather_params` all-gathers them for the forward pass; the backward of the gather is
  a reduce-scatter divided by the axis size, i.e. each shard receives the *mean* gradient;
* :func:`shard_module_params` wraps a flax module so its params live sharded and are
  gathered on use;
* :func:`sync_gradients` averages every other gradient over the axes its parameter is not
  partitioned on.

Differences from the original: boxes are :class:`~core.param_metadata.ParallelPartitioned`
(no sharding constraint inside ``shard_map``), and the reduce-scatter is the package's
backend-aware :func:`~core.distributed.collectives.reduce_scatter` (the gloo stall).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax import lax

from core.distributed.collectives import all_gather, reduce_scatter
from core.param_metadata import ParallelPartitioned

log = logging.getLogger(__name__)


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


def shard_params(params: Any, axis_name: str, min_weight_size: int = 2**18) -> Any:
    """Shard each parameter with more than ``min_weight_size`` elements over ``axis_name``.

    The largest dimension that is divisible by the axis size and not already partitioned is
    split; this device keeps its slice (``lax.axis_index``). Small or indivisible parameters
    are returned unchanged.
    """
    axis_index = lax.axis_index(axis_name)
    axis_size = lax.axis_size(axis_name)

    def split(x: Any) -> Any:
        value, names = (x.value, tuple(x.names)) if _is_box(x) else (x, (None,) * np.ndim(x))
        if axis_name in names or value.size <= min_weight_size:
            return x
        for dim in np.argsort(value.shape)[::-1]:
            if value.shape[dim] % axis_size == 0 and names[dim] is None:
                size = value.shape[dim] // axis_size
                local = lax.dynamic_slice_in_dim(value, axis_index * size, size, axis=int(dim))
                new_names = names[:dim] + (axis_name,) + names[dim + 1:]
                return ParallelPartitioned(local, new_names)
        log.warning("parameter of shape %s not sharded: no dimension divisible by %d", value.shape, axis_size)
        return x

    return jax.tree.map(split, params, is_leaf=_is_box)


def gather_array_with_mean_grads(
    x: jax.Array, axis: int, axis_name: str, gather_dtype: Any = None, grad_scatter_dtype: Any = None
) -> jax.Array:
    """All-gather ``x`` along ``axis``; its gradient is reduce-scattered and divided by the axis size.

    ``gather_dtype`` / ``grad_scatter_dtype`` optionally cast before the communication (e.g. bf16).
    """
    axis_size = lax.axis_size(axis_name)

    @jax.custom_gradient
    def f(x):
        def grad_fn(g):
            if grad_scatter_dtype is not None:
                g = g.astype(grad_scatter_dtype)
            return (reduce_scatter(g, axis_name, scatter_dimension=axis) / axis_size).astype(x.dtype)

        value = x if gather_dtype is None else x.astype(gather_dtype)
        return all_gather(value, axis_name, axis=axis), grad_fn

    return f(x)


def gather_params(params: Any, axis_name: str, gather_dtype: Any = None, grad_scatter_dtype: Any = None) -> Any:
    """Gather every parameter sharded over ``axis_name`` (mean-reduce-scattered gradients)."""

    def gather(p: Any) -> Any:
        if not (_is_box(p) and axis_name in p.names):
            return p
        names = tuple(p.names)
        dim = names.index(axis_name)
        value = gather_array_with_mean_grads(p.value, dim, axis_name, gather_dtype, grad_scatter_dtype)
        rest = names[:dim] + (None,) + names[dim + 1:]
        return ParallelPartitioned(value, rest) if any(n is not None for n in rest) else value

    return jax.tree.map(gather, params, is_leaf=_is_box)


def shard_module_params(
    target: type[nn.Module] | Any,
    axis_name: str,
    min_weight_size: int = 2**18,
    gather_dtype: Any = None,
    grad_scatter_dtype: Any = None,
) -> Any:
    """Wrap a flax module (class or function) so its params are stored sharded and gathered on use."""
    return nn.map_variables(
        target,
        trans_in_fn=functools.partial(gather_params, axis_name=axis_name, gather_dtype=gather_dtype,
                                      grad_scatter_dtype=grad_scatter_dtype),
        trans_out_fn=functools.partial(shard_params, axis_name=axis_name, min_weight_size=min_weight_size),
        mapped_collections="params",
        mutable=True,
    )


def sync_gradients(grads: Any, axis_names: Sequence[str]) -> Any:
    """``pmean`` each gradient over the ``axis_names`` its parameter is not partitioned over."""

    def sync(g: Any) -> Any:
        if _is_box(g):
            names = {n for entry in g.names for n in (entry if isinstance(entry, tuple) else (entry,))}
            replicated = tuple(a for a in axis_names if a not in names)
            return g.replace(value=lax.pmean(g.value, replicated)) if replicated else g
        return lax.pmean(g, tuple(axis_names))

    return jax.tree.map(sync, grads, is_leaf=_is_box)
