"""Gathering one FSDP unit's parameters right before it runs (Megatron-FSDP ``optim_grads_params``).

A model whose parameters are sharded over data parallelism at rest
(:func:`~core.distributed.fsdp.param_sharding.shard_over_data_parallel`) calls
:meth:`ParamGather.unit` on one unit's parameters (the embedding, one transformer layer inside
the layer scan, the output head) where it uses them. Each sharded leaf is

* cast to the compute dtype and all-gathered over its data-parallel axes (the gathered copy
  travels in bf16 under mixed precision, as Megatron-FSDP gathers its compute weights);
* tagged :data:`GATHERED_PARAMS` so that the layer's
  ``jax.checkpoint`` (:func:`~core.transformer.recompute.with_recompute`) does not keep it for
  the backward: the backward gathers it again and the gathered copy is dead after each use
  (``reshard_after_forward``; off, the forward's copy is kept instead: one gather fewer, one
  unit's gathered parameters more per layer held for the backward);
* differentiated as a reduce-scatter of its gradient over the same axes, in ``reduce_dtype``
  (fp32 with ``grad_reduce_in_fp32``): the gradient that reaches the shard is already summed
  over data parallelism, per unit and per microbatch, and only shard-sized gradients live
  across microbatches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from core.distributed.collectives import all_gather, reduce_scatter
from core.param_metadata import ParamInfo

GATHERED_PARAMS = "fsdp_gathered_params"
"""``checkpoint_name`` of a unit's all-gathered parameters (what the layers' ``jax.checkpoint``
policies never keep for the backward, :func:`~core.transformer.recompute.with_recompute`)."""


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def gather_shard(x: jax.Array, dim: int, axes: tuple[str, ...], compute_dtype: Any, reduce_dtype: Any) -> jax.Array:
    """Inside ``shard_map``: the whole parameter from every rank's ``x`` (concatenated along
    ``dim`` over ``axes``) in ``compute_dtype``; its VJP reduce-scatters the gradient in
    ``reduce_dtype`` and returns it in ``x``'s dtype."""
    return all_gather(x.astype(compute_dtype), axes, axis=dim)


def _gather_fwd(x, dim, axes, compute_dtype, reduce_dtype):
    return gather_shard(x, dim, axes, compute_dtype, reduce_dtype), jnp.zeros((), x.dtype)


def _gather_bwd(dim, axes, compute_dtype, reduce_dtype, like, g):
    del compute_dtype
    return (reduce_scatter(g.astype(reduce_dtype), axes, scatter_dimension=dim).astype(like.dtype),)


gather_shard.defvjp(_gather_fwd, _gather_bwd)


@dataclasses.dataclass(frozen=True)
class ParamGather:
    """How a model gathers its FSDP-sharded parameters, unit by unit (set on the model by
    :class:`~core.distributed.DistributedDataParallel` under ``optim_grads_params``)."""

    infos: Any
    """:class:`~core.param_metadata.ParamInfo` tree shaped like the params (``fsdp_dim`` says what to gather)."""
    reduce_dtype: str | None = None
    """dtype in which gradients are reduce-scattered (``"float32"`` with ``grad_reduce_in_fp32``;
    None: the gathered copy's dtype)."""
    reshard_after_forward: bool = True
    """Gather again for the backward instead of keeping the forward's gathered copy."""

    def unit(self, params: Any, path: Sequence[str], compute_dtype: Any = None, stacked: int = 0) -> Any:
        """One unit's parameters, whole (inside ``shard_map``): ``params`` is the subtree at ``path``
        of the model's parameters with its first ``stacked`` dimensions indexed away (a layer
        sliced out of ``[vpp, L, ...]``: 2); sharded leaves are gathered in ``compute_dtype``
        (None: their own), the others returned as they are."""
        infos = self.infos
        for key in path:
            infos = infos[key]

        def leaf(x: jax.Array, info: ParamInfo) -> jax.Array:
            if not info.fsdp_sharded:
                return x
            dtype = jnp.dtype(compute_dtype if compute_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
                              else x.dtype)
            reduce = jnp.dtype(self.reduce_dtype) if self.reduce_dtype is not None else dtype
            whole = gather_shard(x, info.fsdp_dim - stacked, info.fsdp_axes, dtype, reduce)
            return checkpoint_name(whole, GATHERED_PARAMS)

        return jax.tree.map(leaf, params, infos)

    @property
    def specs(self) -> Any:
        """The parameters' partition specs at rest (FSDP splits included)."""
        return jax.tree.map(lambda i: i.partition_spec, self.infos)
