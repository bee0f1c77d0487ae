"""Array helpers for code inside ``jax.shard_map``, with the xlstm_jax API.

Same names and semantics as ``xlstm_jax.distributed.array_utils`` (copied there from the JAX
scaling tutorials):

* :func:`fold_rng_over_axis` gives every device along a mesh axis (or tuple of axes) its own
  key, e.g. different dropout masks on every data-parallel rank;
* :func:`split_array_over_mesh` keeps this device's slice of a replicated array;
* :func:`stack_params` / :func:`unstack_params` add / remove the size-1 model-axis dimension
  that gives every rank of that axis its own parameter shard (what
  :class:`core.tensor_parallel.tp_dense.ModelParallelismWrapper` uses).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from core.param_metadata import ParallelPartitioned

AxisName = str | Sequence[str]
"""One mesh axis name or a tuple of them (a tuple acts as the product axis, major first)."""


def fold_rng_over_axis(rng: jax.Array, axis_name: AxisName) -> jax.Array:
    """Fold this device's index along ``axis_name`` into ``rng``: a different key per device.

    Exactly the tutorial's and xlstm_jax's ``jax.random.fold_in(rng, lax.axis_index(axis_name))``.
    For a tuple of axes, ``lax.axis_index`` is the linear index over them (the first axis
    major), so a single fold gives every device of the product group a distinct key; devices
    that differ only along other axes get the same key. Call it inside ``jax.shard_map``.

    Args:
        rng: A PRNG key (typed ``jax.random.key`` or raw ``PRNGKey``).
        axis_name: The mesh axis, or tuple of axes, to fold over.

    Returns:
        ``rng`` folded with the device's index along ``axis_name``.
    """
    axis_name = tuple(axis_name) if not isinstance(axis_name, str) else axis_name
    return jax.random.fold_in(rng, lax.axis_index(axis_name))


def split_array_over_mesh(x: jax.Array, axis_name: str, split_axis: int) -> jax.Array:
    """This device's slice of ``x`` along dimension ``split_axis``, split evenly over ``axis_name``.

    The device with index ``i`` along the axis keeps the ``i``-th of ``axis_size`` equal chunks;
    with an axis of size 1, ``x`` is returned unchanged.

    Raises:
        ValueError: if ``x.shape[split_axis]`` is not divisible by the axis size (the
            original silently dropped the remainder).
    """
    axis_size = lax.axis_size(axis_name)
    if axis_size == 1:
        return x
    if x.shape[split_axis] % axis_size:
        raise ValueError(
            f"cannot split dimension {split_axis} of size {x.shape[split_axis]} evenly over the "
            f"{axis_size} devices of mesh axis {axis_name!r}")
    slice_size = x.shape[split_axis] // axis_size
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis_name) * slice_size, slice_size, axis=split_axis)


def stack_params(params: Any, axis_name: str, axis: int = 0, mask_except: jax.Array | int | None = None) -> Any:
    """Add a dimension of size 1 partitioned over ``axis_name`` at position ``axis`` to every param.

    Each leaf becomes a partitioned box (``names`` gains ``axis_name`` at ``axis``), so the
    params of every rank of ``axis_name`` form one global array stacked along that dimension.
    With ``mask_except`` set, the values are zero except on that rank of the axis.
    """

    def stack(x):
        value, names = (x.value, tuple(x.names)) if _is_box(x) else (x, (None,) * jnp.ndim(x))
        if mask_except is not None:
            value = jnp.where(lax.axis_index(axis_name) == mask_except, value, jnp.zeros_like(value))
        return ParallelPartitioned(jnp.expand_dims(value, axis), names[:axis] + (axis_name,) + names[axis:])

    return jax.tree.map(stack, params, is_leaf=_is_box)


def unstack_params(params: Any, axis_name: str) -> Any:
    """Remove the ``axis_name`` dimension that :func:`stack_params` added (inverse operation).

    Boxes left without any partitioned dimension are returned as plain arrays; leaves not
    partitioned over ``axis_name`` are unchanged.
    """

    def unstack(x):
        if not (_is_box(x) and axis_name in x.names):
            return x
        names = tuple(x.names)
        dim = names.index(axis_name)
        rest = names[:dim] + names[dim + 1:]
        value = jnp.squeeze(x.value, dim)
        return ParallelPartitioned(value, rest) if any(n is not None for n in rest) else value

    return jax.tree.map(unstack, params, is_leaf=_is_box)


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


__all__ = ["AxisName", "fold_rng_over_axis", "split_array_over_mesh", "stack_params", "unstack_params"]


def unstack_device_local(tree: Any) -> Any:
    """Inside ``shard_map``: this device's values of a tree of device-local values (global
    arrays with a leading axis of one entry per device, spec ``P(all mesh axes)``)."""
    return jax.tree.map(lambda x: x[0], tree)


def stack_device_local(tree: Any) -> Any:
    """Inside ``shard_map``: this device's values with the leading per-device axis that
    device-local values carry outside (the inverse of :func:`unstack_device_local`)."""
    return jax.tree.map(lambda x: x[None], tree)
