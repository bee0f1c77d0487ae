"""Gathering one FSDP unit's parameters right before it runs (Megatron-FSDP ``optim_grads_params``).

A model whose parameters are sharded over data parallelism at rest
(:func:`~core.distributed.fsdp.param_sharding.shard_over_data_parallel`) gathers one unit's
parameters (the embedding, one transformer layer inside the layer scan, the output head) where
it uses them. Each sharded leaf is cast to the compute dtype and all-gathered over its
data-parallel axes (the gathered copy travels in bf16 under mixed precision, as Megatron-FSDP
gathers its compute weights), and its gradient is reduce-scattered over the same axes, in
``reduce_dtype`` (fp32 with ``grad_reduce_in_fp32``): the gradient that reaches the shard is
summed over data parallelism already, per unit and per microbatch, so only shard-sized
gradients live across microbatches.

Two ways, :class:`ParamGather`'s two methods:

* :meth:`ParamGather.call` runs the unit itself with a VJP of its own: the forward gathers, runs
  the unit and keeps what its backward needs *except* the gathered parameters (residuals that
  are the gathered arrays themselves, as the package's linear layers keep their weights); the
  backward gathers them again, runs the unit's backward and reduce-scatters the parameters'
  grads. The gathered copy is dead once the unit has run, in the forward and in the backward
  (``reshard_after_forward``; off, the forward's copy is kept for the backward instead);
* :meth:`ParamGather.unit` returns the gathered parameters (differentiable: the gathers'
  transposes reduce-scatter); a unit rematerialised by ``jax.checkpoint`` (activation
  recompute) gathers again in its backward by construction.

Under ``--scan-layers`` each layer's gather and reduce-scatter sit in the scan body, so at most
about one layer's gathered parameters and unreduced grads exist at a time. With the layers
unrolled XLA's scheduler places the collectives (on GPUs the latency-hiding scheduler, within
its memory limit; the CPU's list scheduler may keep several layers' copies alive).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from core.distributed.collectives import all_gather, reduce_scatter
from core.param_metadata import ParamInfo, keep_fsdp_block


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


def _gathered_dtype(x: jax.Array, compute_dtype: Any) -> Any:
    """The dtype a leaf is gathered in: ``compute_dtype`` for floating leaves (None: their own)."""
    return jnp.dtype(compute_dtype if compute_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype)


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

    def infos_at(self, path: Sequence[str]) -> Any:
        """The :class:`~core.param_metadata.ParamInfo` subtree at ``path`` of the parameters."""
        infos = self.infos
        for key in path:
            infos = infos[key]
        return infos

    def call(self, fn: Callable[[Any, Any], Any], params: Any, x: Any, infos: Any,
             compute_dtype: Any = None, stacked: int = 0, prefetched: Any = None) -> Any:
        """``fn(whole_params, x)`` for one unit whose parameters ``params`` (``infos``: their
        :class:`~core.param_metadata.ParamInfo` subtree, :meth:`infos_at`; ``stacked`` as for
        :meth:`unit`) are gathered for it in ``compute_dtype``, or were gathered ahead
        (``prefetched``: :meth:`gather_ahead`'s value, issued while the unit before ran). With
        ``reshard_after_forward`` the unit's VJP keeps only the shards and whatever else ``fn``'s
        backward needs (``fn`` may be rematerialised: ``jax.checkpoint``): the backward gathers
        the parameters again (the forward's gathered copy is dead once ``fn`` has run), runs
        ``fn``'s backward and reduce-scatters the parameters' grads. Without it the forward's copy
        is kept (:meth:`unit`; ``prefetched`` is not used). ``x`` (a pytree of arrays) is
        differentiated; anything else ``fn`` uses it closes over."""
        if not self.reshard_after_forward:
            return fn(self._gather_with_vjp(params, infos, compute_dtype, stacked), x)
        gather = lambda p: self._gather(p, infos, compute_dtype, stacked)
        static: dict[str, Any] = {}

        @jax.custom_vjp
        def call(params, x, ahead):
            return fn(gather(params) if ahead is None else ahead, x)

        def call_fwd(params, x, ahead):
            whole = gather(params) if ahead is None else ahead
            y, backward = jax.vjp(fn, whole, x)
            residuals, static["tree"] = jax.tree.flatten(backward)
            # Residuals that are gathered parameters themselves are not kept: the backward
            # gathers them again from the shards.
            position = {id(w): j for j, w in enumerate(jax.tree.leaves(whole))}
            static["regathered"] = [position.get(id(r)) for r in residuals]
            kept = [None if j is not None else r for r, j in zip(residuals, static["regathered"], strict=True)]
            return y, (params, kept)

        def call_bwd(saved, g):
            params, kept = saved
            whole = jax.tree.leaves(gather(params))
            residuals = [whole[j] if j is not None else r for r, j in zip(kept, static["regathered"], strict=True)]
            d_whole, dx = jax.tree.unflatten(static["tree"], residuals)(g)
            # The prefetched copy is a stop-gradient value: its cotangent is dropped.
            no_ahead = None if prefetched is None else jax.tree.map(jnp.zeros_like, prefetched)
            return self._scatter(d_whole, params, infos, stacked), dx, no_ahead

        call.defvjp(call_fwd, call_bwd)
        return call(params, x, prefetched)

    def gather_ahead(self, params: Any, infos: Any, compute_dtype: Any = None, stacked: int = 0) -> Any:
        """A unit's parameters gathered ahead of its use (the next unit's, issued before the current
        unit's compute so the collective can overlap it), for :meth:`call`'s ``prefetched``. No
        gradient flows through it: :meth:`call` reduce-scatters the unit's grads into ``params``."""
        return lax.stop_gradient(self._gather(lax.stop_gradient(params), infos, compute_dtype, stacked))

    def _reduce_dtype(self, gathered: Any) -> Any:
        """The dtype a gradient is reduce-scattered in: ``reduce_dtype``, else the gathered copy's."""
        return jnp.dtype(self.reduce_dtype) if self.reduce_dtype is not None else jnp.dtype(gathered)

    def _gather(self, params: Any, infos: Any, compute_dtype: Any, stacked: int) -> Any:
        """Every leaf whole (sharded leaves all-gathered), in ``compute_dtype`` (None: its own)."""
        def leaf(x: jax.Array, info: ParamInfo) -> jax.Array:
            dtype = _gathered_dtype(x, compute_dtype)
            if not info.fsdp_sharded:
                return x.astype(dtype)
            return all_gather(x.astype(dtype), info.fsdp_axes, axis=info.fsdp_dim - stacked)

        return jax.tree.map(leaf, params, infos)

    def _scatter(self, grads: Any, params: Any, infos: Any, stacked: int) -> Any:
        """The transpose of :meth:`_gather`: each sharded leaf's grad reduce-scattered (in
        ``reduce_dtype``), every grad in its parameter's dtype."""
        def leaf(g: jax.Array, x: jax.Array, info: ParamInfo) -> jax.Array:
            if not info.fsdp_sharded:
                return g.astype(x.dtype)
            dim = info.fsdp_dim - stacked
            return reduce_scatter(g.astype(self._reduce_dtype(g.dtype)), info.fsdp_axes, scatter_dimension=dim
                                  ).astype(x.dtype)

        return jax.tree.map(leaf, grads, params, infos)

    def unit(self, params: Any, path: Sequence[str], compute_dtype: Any = None, stacked: int = 0) -> Any:
        """One unit's parameters, whole (inside ``shard_map``): ``params`` is the subtree at ``path``
        of the model's parameters with its first ``stacked`` dimensions indexed away (a layer
        sliced out of ``[vpp, L, ...]``: 2); sharded leaves are gathered in ``compute_dtype``
        (None: their own), the others returned as they are. Differentiable (the gathers'
        transposes reduce-scatter); whatever the caller's backward needs of the gathered copy is
        kept from the forward unless the caller is rematerialised (``jax.checkpoint``)."""
        return self._gather_with_vjp(params, self.infos_at(path), compute_dtype, stacked)

    def _gather_with_vjp(self, params: Any, infos: Any, compute_dtype: Any, stacked: int) -> Any:
        def leaf(x: jax.Array, info: ParamInfo) -> jax.Array:
            if not info.fsdp_sharded:
                return x
            dtype = _gathered_dtype(x, compute_dtype)
            return gather_shard(x, info.fsdp_dim - stacked, info.fsdp_axes, dtype, self._reduce_dtype(dtype))

        return jax.tree.map(leaf, params, infos)

    def keep_block(self, params: Any, path: Sequence[str], stacked: int = 0) -> Any:
        """Inside ``shard_map``, while creating parameters: this rank's block of every sharded leaf
        of one unit just created whole (``params``: the subtree at ``path``, boxed or not, with
        its first ``stacked`` dimensions absent: one layer of the ``[vpp, L, ...]`` stack is 2), so
        a model creates its parameters unit by unit without holding more than one unit whole."""
        def leaf(box: Any, info: ParamInfo) -> Any:
            if isinstance(box, nn.meta.AxisMetadata):
                return box.replace_boxed(keep_fsdp_block(box.value, info, stacked))
            return keep_fsdp_block(box, info, stacked)

        return jax.tree.map(leaf, params, self.infos_at(path), is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))

    @property
    def specs(self) -> Any:
        """The parameters' partition specs at rest (FSDP splits included)."""
        return jax.tree.map(lambda i: i.partition_spec, self.infos)
