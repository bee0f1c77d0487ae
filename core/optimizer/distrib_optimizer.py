"""The optimizer over bucketed buffers: replicated, or distributed (ZeRO-1) over data parallelism.

Both paths work on the DDP's flat buckets rather than the parameter tree:

* distributed (``use_distributed_optimizer``): each data-parallel rank keeps the fp32 master
  params (only for non-fp32 params; fp32 params are their own master, as in Megatron) and the
  optax state for *its contiguous shard of every bucket* (shards ignore parameter boundaries),
  steps it with the reduce-scattered grad shard, and all-gathers the updated shard into the
  full bucket, which is unflattened back into the parameter tree;
* replicated: the same code with the whole bucket as the "shard" and no gather.

Any optax ``GradientTransformation`` works if it is *elementwise* (Adam, SGD, momentum, ...):
then stepping shards gives exactly the update of stepping whole parameters. Transformations
that look at a parameter as a whole (per-parameter norms as in LAMB, global-norm clipping
inside the chain) would see shards instead; global-norm clipping is done here, across all
ranks, before the transformation. Weight decay with a per-element mask is provided by
:func:`core.optimizer.optimizer_config.get_optax_transformation` when given an
``OptimizerConfig``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from core.distributed.collectives import all_gather
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.grad_sync import axes_size, reduction_axes
from core.distributed.param_and_grad_buffer import (
    BufferSpec,
    bucket_element_masks,
    flatten_to_buckets,
    unflatten_from_buckets,
)
from core.optimizer.clip_grads import bucket_norm_weights, clip_coefficient, get_grad_norm_fp32
from core.optimizer.optimizer_config import OptimizerConfig, get_optax_transformation
from core.parallel_state import PP_AXIS, TP_AXIS, ParallelState
from core.param_metadata import ParamInfo

Buckets = tuple[jax.Array, ...]


@dataclasses.dataclass(frozen=True)
class BufferMasks:
    """Per-element constant masks of every bucket of every buffer (numpy bool arrays)."""

    decay: tuple[tuple[np.ndarray, ...], ...]
    """Weight decay applies (params with more than one dimension)."""
    tp_split: tuple[tuple[np.ndarray, ...], ...]
    """Param is split over tensor parallelism (counted on every tp rank in the norm)."""
    pp_split: tuple[tuple[np.ndarray, ...], ...]
    """Param is split over pipeline stages (counted on every stage in the norm)."""

    @classmethod
    def build(cls, specs: Sequence[BufferSpec], infos: Sequence[ParamInfo]) -> BufferMasks:
        """Masks from the buffer specs and the per-leaf ParamInfo (flattened tree order)."""

        def masks(flag: Callable[[int], bool]):
            return tuple(bucket_element_masks(s, [flag(i) for i in s.leaves]) for s in specs)

        ndim = {i: len(shape) for s in specs for i, shape in zip(s.leaves, s.shapes, strict=True)}
        spec_axes = [{a for e in info.partition_spec for a in (e if isinstance(e, tuple) else (e,))} for info in infos]
        return cls(
            decay=masks(lambda i: ndim[i] > 1),
            tp_split=masks(lambda i: TP_AXIS in spec_axes[i]),
            pp_split=masks(lambda i: PP_AXIS in spec_axes[i]),
        )

    def as_arrays(self, sharding: jax.sharding.Sharding) -> dict[str, Any]:
        """The masks as a pytree of arrays placed with ``sharding`` (the step's replicated
        ``NamedSharding(mesh, P())``; an array on one device would be copied to every device
        at each call of the step). Pass them to the jitted step as an argument."""
        return {f.name: jax.tree.map(lambda x: jax.device_put(x, sharding), getattr(self, f.name))
                for f in dataclasses.fields(self)}


class DistributedOptimizer:
    """Steps bucketed params with reduced (and, if distributed, sharded) grad buckets.

    Pure underneath: :meth:`init` and :meth:`step` run inside the DDP's ``shard_map`` and
    return new values; the object only holds static configuration.
    """

    def __init__(
        self,
        optimizer: optax.GradientTransformation | OptimizerConfig,
        specs: Sequence[BufferSpec],
        state: ParallelState,
        ddp_config: DistributedDataParallelConfig,
        learning_rate: float | optax.Schedule | None = None,
        clip_grad: float | None = None,
    ):
        self.optimizer = optimizer
        self.specs = tuple(specs)
        self.state = state
        self.ddp_config = ddp_config
        self.learning_rate = learning_rate
        default_clip = optimizer.clip_grad if isinstance(optimizer, OptimizerConfig) else 0.0
        self.clip_grad = default_clip if clip_grad is None else clip_grad

    @property
    def sharded(self) -> bool:
        """Whether optimizer state is sharded over data parallelism."""
        return self.ddp_config.use_distributed_optimizer

    def _tx(self, decay_mask: Any = None) -> optax.GradientTransformation:
        if isinstance(self.optimizer, OptimizerConfig):
            return get_optax_transformation(self.optimizer, self.learning_rate, decay_mask)
        return self.optimizer

    # -- shards ----------------------------------------------------------------------------
    def _shard(self, bucket: jax.Array, spec: BufferSpec) -> jax.Array:
        """This rank's shard of a full bucket (the whole bucket when not sharded)."""
        if not self.sharded:
            return bucket
        axes = reduction_axes(spec, self.state)
        n = axes_size(self.state, axes)
        size = bucket.shape[0] // n
        return lax.dynamic_slice_in_dim(bucket, lax.axis_index(axes) * size, size)

    def _shards(self, per_bucket: Sequence[Buckets]) -> tuple[Buckets, ...]:
        return tuple(tuple(self._shard(b, s) for b in bs) for s, bs in zip(self.specs, per_bucket, strict=True))

    def _param_shards(self, param_leaves: Sequence[jax.Array]) -> tuple[Buckets, ...]:
        return self._shards([flatten_to_buckets(param_leaves, s, jnp.float32) for s in self.specs])

    # -- pure API --------------------------------------------------------------------------
    def init(self, param_leaves: Sequence[jax.Array]) -> dict[str, Any]:
        """Optimizer state for this rank: fp32 master shards (non-fp32 buffers) and the optax state."""
        shards = self._param_shards(param_leaves)
        master = tuple(s if spec.key.param_dtype != "float32" else ()
                       for spec, s in zip(self.specs, shards, strict=True))
        return {"master": master, "inner": self._tx().init(shards)}

    def _gather_buckets(self, shards: Buckets, spec: BufferSpec) -> Buckets:
        """Full buckets from this rank's updated shards: one all-gather per bucket with
        ``overlap_param_gather`` (each can overlap with compute on its own), else one per buffer."""
        axes = reduction_axes(spec, self.state)
        if self.ddp_config.overlap_param_gather or len(shards) == 1:
            return tuple(all_gather(s, axes) for s in shards)
        return _gather_all_buckets_at_once(shards, axes)

    def grad_norm(self, grad_shards: Sequence[Buckets], masks: dict[str, Any]) -> jax.Array:
        """Global L2 norm of the reduced gradients across every rank (see ``clip_grads``).

        Replicated: every rank of a buffer's reduction group counts its whole (identical) bucket
        and the sum runs over the other mesh axes only; distributed: each rank counts its shard
        and the sum runs over every axis. Non-finite elements make the norm non-finite even
        where this device does not count them (0/1 weights multiply)."""
        sumsq: dict[tuple[str, ...], list[jax.Array]] = {}
        for b_spec, shards, tp_m, pp_m in zip(self.specs, grad_shards, masks["tp_split"], masks["pp_split"],
                                              strict=True):
            axes = tuple(self.state.mesh.axis_names)
            if not self.sharded:
                replicated_over = reduction_axes(b_spec, self.state)
                axes = tuple(a for a in axes if a not in replicated_over)
            for g, tp_split, pp_split in zip(shards, tp_m, pp_m, strict=True):
                w = bucket_norm_weights(self._shard(tp_split, b_spec), self._shard(pp_split, b_spec), self.state)
                g32 = g.astype(jnp.float32)
                sumsq.setdefault(axes, []).append(jnp.sum(w.astype(jnp.float32) * (g32 * g32)))
        return get_grad_norm_fp32(sumsq, self.state)

    def step(
        self, opt_state: dict[str, Any], grad_shards: Sequence[Buckets], param_leaves: Sequence[jax.Array],
        masks: dict[str, Any], skip_nonfinite: bool = False,
    ) -> tuple[dict[int, jax.Array], dict[str, Any], jax.Array, jax.Array]:
        """Clip, step the shards, gather. Returns ({leaf index: new param}, new state, grad norm,
        skipped).

        With ``skip_nonfinite`` a non-finite global grad norm (a NaN or Inf in any rank's
        gradients; the norm is the same on every rank) leaves params and state unchanged and
        ``skipped`` is true. The update is selected in a ``lax.cond``: on CPU a ``jnp.where``
        between old and new values costs two extra passes over the optimizer state and copies
        of it every step.
        """
        grad_norm = self.grad_norm(grad_shards, masks)
        skip = ~jnp.isfinite(grad_norm) if skip_nonfinite else None
        grads = tuple(tuple(g.astype(jnp.float32) for g in bs) for bs in grad_shards)
        if self.clip_grad > 0:
            coef = clip_coefficient(grad_norm, self.clip_grad)
            grads = jax.tree.map(lambda g: g * coef, grads)
        current = self._param_shards(param_leaves)
        current = tuple(m if m else c for m, c in zip(opt_state["master"], current, strict=True))
        decay = tuple(tuple(self._shard(m, s) for m in ms) for s, ms in zip(self.specs, masks["decay"], strict=True))

        def update(operands):
            grads, inner, current = operands
            updates, inner = self._tx(decay).update(grads, inner, current)
            return optax.apply_updates(current, updates), inner

        operands = (grads, opt_state["inner"], current)
        if skip is None:
            new_shards, inner = update(operands)
        else:
            new_shards, inner = lax.cond(skip, lambda ops: (ops[2], ops[1]), update, operands)
        new_leaves: dict[int, jax.Array] = {}
        for spec, shards in zip(self.specs, new_shards, strict=True):
            # Gather in the param dtype, as Megatron gathers param_data (bf16).
            shards = tuple(s.astype(jnp.dtype(spec.key.param_dtype)) for s in shards)
            full = self._gather_buckets(shards, spec) if self.sharded else shards
            new_leaves.update(unflatten_from_buckets(full, spec))
        master = tuple(s if m else () for m, s in zip(opt_state["master"], new_shards, strict=True))
        skipped = jnp.zeros((), bool) if skip is None else skip
        return new_leaves, {"master": master, "inner": inner}, grad_norm, skipped


def _gather_all_buckets_at_once(shards: Buckets, axes: tuple[str, ...]) -> Buckets:
    """One all-gather for a whole buffer: concatenate the bucket shards, gather, re-split."""
    sizes = [s.shape[0] for s in shards]
    gathered = all_gather(jnp.concatenate(shards), axes).reshape(-1, sum(sizes))  # [dp, sum of shards]
    offsets = np.cumsum([0, *sizes])
    return tuple(gathered[:, a:b].reshape(-1) for a, b in zip(offsets[:-1], offsets[1:], strict=True))


def optimizer_state_bytes(opt_state: Any) -> int:
    """Bytes of optimizer state (master params + optax state) held by one device."""
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(opt_state)))
