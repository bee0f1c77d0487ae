"""Megatron's paired tensor-parallel communication regions, as ``jax.custom_vjp`` functions.

Each function is a forward collective paired with a fixed backward collective, exactly as in
Megatron-core's ``mappings.py``; they run inside ``jax.shard_map`` (with ``check_vma=False``)
over the tensor-parallel mesh axis. Sequence-parallel functions split or gather dim 0 (the
sequence dim of Megatron's ``[s, b, h]`` activations); the others the last dim. With one
tensor-parallel rank every function is the identity.

| function | forward | backward |
|---|---|---|
| copy_to_tensor_model_parallel_region | identity | all-reduce |
| reduce_from_tensor_model_parallel_region | all-reduce | identity |
| scatter_to_tensor_model_parallel_region | keep own last-dim chunk | all-gather last dim |
| gather_from_tensor_model_parallel_region | all-gather last dim | keep own chunk |
| scatter_to_sequence_parallel_region | keep own dim-0 chunk | all-gather dim 0 |
| gather_from_sequence_parallel_region | all-gather dim 0 | reduce-scatter dim 0 (split if flag False) |
| reduce_scatter_to_sequence_parallel_region | reduce-scatter dim 0 | all-gather dim 0 |
| all_gather_last_dim_from_tensor_parallel_region | all-gather last dim | reduce-scatter last dim |
| reduce_scatter_last_dim_to_tensor_parallel_region | reduce-scatter last dim | all-gather last dim |
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax import lax

from core.distributed.collectives import all_gather, reduce_scatter
from core.parallel_state import TP_AXIS

Axis = str | tuple[str, ...]


# -- primitive collectives (not differentiated directly) ----------------------------------
def _all_reduce(x: jax.Array, axis: Axis) -> jax.Array:
    return lax.psum(x, axis)


def _split(x: jax.Array, axis: Axis, dim: int) -> jax.Array:
    n = lax.axis_size(axis)
    dim = dim % x.ndim
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by tensor-parallel size {n}")
    size = x.shape[dim] // n
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis) * size, size, axis=dim)


def _gather(x: jax.Array, axis: Axis, dim: int) -> jax.Array:
    return all_gather(x, axis, axis=dim % x.ndim)


def _reduce_scatter(x: jax.Array, axis: Axis, dim: int) -> jax.Array:
    return reduce_scatter(x, axis, scatter_dimension=dim % x.ndim)


def _identity(x: jax.Array, axis: Axis) -> jax.Array:
    del axis
    return x


def _region(forward: Callable, backward: Callable, name: str, doc: str) -> Callable:
    """A custom_vjp function with the given forward and backward collectives."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def region(x, axis_name):
        return forward(x, axis_name)

    def fwd(x, axis_name):
        return forward(x, axis_name), None

    def bwd(axis_name, _, g):
        return (backward(g, axis_name),)

    region.defvjp(fwd, bwd)

    def apply(x: jax.Array, axis_name: Axis = TP_AXIS) -> jax.Array:
        if lax.axis_size(axis_name) == 1:
            return x
        return region(x, axis_name)

    apply.__name__ = apply.__qualname__ = name
    apply.__doc__ = doc
    return apply


_first = lambda op: (lambda x, a: op(x, a, 0))
_last = lambda op: (lambda x, a: op(x, a, -1))

copy_to_tensor_model_parallel_region = _region(
    _identity, _all_reduce, "copy_to_tensor_model_parallel_region",
    "Forward: identity. Backward: all-reduce over tp.")
reduce_from_tensor_model_parallel_region = _region(
    _all_reduce, _identity, "reduce_from_tensor_model_parallel_region",
    "Forward: all-reduce over tp. Backward: identity.")
scatter_to_tensor_model_parallel_region = _region(
    _last(_split), _last(_gather), "scatter_to_tensor_model_parallel_region",
    "Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim.")
gather_from_tensor_model_parallel_region = _region(
    _last(_gather), _last(_split), "gather_from_tensor_model_parallel_region",
    "Forward: all-gather the last dim. Backward: keep this rank's chunk.")
scatter_to_sequence_parallel_region = _region(
    _first(_split), _first(_gather), "scatter_to_sequence_parallel_region",
    "Forward: keep this rank's chunk of dim 0 (sequence). Backward: all-gather dim 0.")
_gather_seq_reduce_scatter_grad = _region(
    _first(_gather), _first(_reduce_scatter), "gather_from_sequence_parallel_region",
    "Forward: all-gather dim 0. Backward: reduce-scatter dim 0.")
_gather_seq_split_grad = _region(
    _first(_gather), _first(_split), "gather_from_sequence_parallel_region",
    "Forward: all-gather dim 0. Backward: keep this rank's chunk of dim 0.")
reduce_scatter_to_sequence_parallel_region = _region(
    _first(_reduce_scatter), _first(_gather), "reduce_scatter_to_sequence_parallel_region",
    "Forward: reduce-scatter dim 0. Backward: all-gather dim 0.")
all_gather_last_dim_from_tensor_parallel_region = _region(
    _last(_gather), _last(_reduce_scatter), "all_gather_last_dim_from_tensor_parallel_region",
    "Forward: all-gather the last dim. Backward: reduce-scatter the last dim.")
reduce_scatter_last_dim_to_tensor_parallel_region = _region(
    _last(_reduce_scatter), _last(_gather), "reduce_scatter_last_dim_to_tensor_parallel_region",
    "Forward: reduce-scatter the last dim. Backward: all-gather the last dim.")


def gather_from_sequence_parallel_region(
    x: jax.Array, tensor_parallel_output_grad: bool = True, axis_name: Axis = TP_AXIS
) -> jax.Array:
    """Forward: all-gather dim 0. Backward: reduce-scatter dim 0, or only split it when the
    consumer's output grad is not tensor-parallel (``tensor_parallel_output_grad=False``)."""
    if tensor_parallel_output_grad:
        return _gather_seq_reduce_scatter_grad(x, axis_name)
    return _gather_seq_split_grad(x, axis_name)
