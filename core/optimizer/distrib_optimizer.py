"""The optimizer of the DDP step: replicated, or distributed (ZeRO-1) over data parallelism.

* distributed (``use_distributed_optimizer``): each data-parallel rank keeps the fp32 master
  params (only for non-fp32 params; fp32 params are their own master, as in Megatron) and the
  optax state for *its contiguous shard of every bucket* (shards ignore parameter boundaries),
  steps it with the reduce-scattered grad shard, and all-gathers the updated shard into the
  full bucket, which is unflattened back into the parameter tree;
* partial distributed (``num_distributed_optimizer_instances`` = I > 1, Megatron's partial
  DistOpt): the same, with the data-parallel group split into I instances of g = dp/I
  contiguous ranks: rank r keeps shard ``r mod g`` of g per bucket (state per device 1/g
  instead of 1/dp), the grad shard comes from a reduce-scatter inside the instance plus an
  all-reduce across instances (``grad_sync``), and the updated shards are all-gathered inside
  the instance. The I copies of a shard get bit-identical grads and so stay identical; the
  global norm counts instance 0's copy only (the others are weighted by 0);
* replicated (Megatron's default): the optimizer steps every parameter with its reduced
  gradient (Megatron's optimizer over ``param.main_grad``); the fp32 masters of non-fp32
  params and the optax state are per-leaf trees split like the parameters. Stepping flat
  buckets instead would flatten the parameters and slice the updated buckets back into leaves
  every step: the compiled program moves more bytes than the per-leaf ``pmean`` recipe's and
  the part of the step after the backward is slower (``bench/optimizer_step.py``; see
  ``bench/results/2026-11-ddp-optimizer-cpu.md``).

Any optax ``GradientTransformation`` works if it is *elementwise* (Adam, SGD, momentum, ...):
then stepping shards gives exactly the update of stepping whole parameters. Transformations
that look at a parameter as a whole (per-parameter norms as in LAMB, global-norm clipping
inside the chain) would see shards instead; global-norm clipping is done here, across all
ranks, before the transformation. Weight decay with a per-element mask is provided by
:func:`core.optimizer.optimizer_config.get_optax_transformation` when given an
``OptimizerConfig``.

The module is long (about 670 lines) because the shard layout is one concern seen from three
sides that must agree element for element: the step on bucket shards, the norms and flags per
shard, and the conversions between the shards and the layout-independent form checkpoints
store (chunked so their temporaries stay bounded); each side reads the same shard arithmetic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from core.distributed.collectives import all_gather, group_index, group_size
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.grad_sync import (
    check_for_large_grads,
    distributed_optimizer_groups,
    init_large_grad_tracker,
    reduction_axes,
)
from core.distributed.param_and_grad_buffer import (
    BufferSpec,
    bucket_flag_changes,
    flatten_bucket_shard,
    unflatten_from_buckets,
)
from core.distributed.spiky_loss import init_spiky_loss_tracker
from core.distributed.storage_split import StorageSplit, reduce_pieces
from core.optimizer.clip_grads import bucket_norm_weights, clip_coefficient, get_grad_norm_fp32
from core.optimizer.optimizer_config import OptimizerConfig, get_optax_transformation
from core.parallel_state import PP_AXIS, TP_AXIS, ParallelState
from core.param_metadata import ParamInfo

Buckets = tuple[jax.Array, ...]
CONVERT_GROUP_MIN_ELEMENTS = 1 << 20
"""Smallest group (elements; 4 MiB in fp32) in which :meth:`DistributedOptimizer.state_to_global`
converts params. Each group is one collective per kind, after the group before: groups as small
as one small parameter make a conversion latency-bound (one collective round per parameter),
while the temporaries are about twice a group (the pieces and their concatenation), so this
minimum keeps the collectives few at a few MiB of temporaries per device
(``bench/results/2026-11-checkpoints-cpu.md``)."""
CONVERT_CHUNK_ELEMENTS = 1 << 24
"""Largest piece (elements; 64 MiB in fp32) of one parameter that the conversions between the
bucket shards and the layout-independent form (:meth:`DistributedOptimizer.state_to_global`,
:meth:`~DistributedOptimizer.state_from_global`) handle at once: a larger parameter goes in
chunks (:func:`_chunks`), one collective each, so their temporaries stay about a few
chunks whatever the model size. Stacked layers make the largest parameter all layers of one
weight (1.5 GiB in fp32 for the MLP weight of a GPT of 24 layers and hidden 2048), and its
whole conversion would need temporaries of one to two times that per device. Smaller chunks
make the conversion programs slower to compile (``bench/results/2026-11-checkpoints-cpu.md``)."""
FLAG_COMPARE_MAX_FLIPS = 256
"""Up to this many flips of a flag in one bucket (:meth:`DistributedOptimizer._shard_flags`),
each element counts the flips before it with one comparison per flip, which XLA fuses into the
optimizer's update: close to the cost of a stored mask for a few flips, growing with their
number. More flips (one leaf per layer, a flag flipping at each) mark each flip in the shard and
take a cumulative sum, a cost independent of their number that the comparisons reach at about
this many flips (a binary search, ``jnp.searchsorted``, is slower than both). The package's GPT
stacks its layers: at most 5 flips. See ``bench/results/2026-11-ddp-optimizer-cpu.md``."""
TRACKERS = ("large_grads", "spiky_loss")
"""Per-device entries of the optimizer state kept by the step's checks (not saved in checkpoints)."""


@dataclasses.dataclass(frozen=True)
class LeafFlags:
    """Per-parameter constants of the optimizer, one entry per leaf (flattened tree order)."""

    decay: tuple[bool, ...]
    """Weight decay applies (params with more than one dimension, Megatron's rule)."""
    tp_split: tuple[bool, ...]
    """Param is split over tensor parallelism (counted on every tp rank in the norm)."""
    pp_split: tuple[bool, ...]
    """Param is split over pipeline stages (counted on every stage in the norm)."""

    @classmethod
    def build(cls, specs: Sequence[BufferSpec], infos: Sequence[ParamInfo]) -> LeafFlags:
        """Flags from the buffer specs (local shapes) and the per-leaf ParamInfo."""
        ndim = {i: len(shape) for s in specs for i, shape in zip(s.leaves, s.shapes, strict=True)}
        return cls(decay=tuple(ndim[i] > 1 for i in range(len(infos))),
                   tp_split=tuple(info.split_over(TP_AXIS) for info in infos),
                   pp_split=tuple(info.split_over(PP_AXIS) for info in infos))


def _has_master(master: Any) -> bool:
    """Whether an entry of the ``master`` state holds fp32 copies (``()`` for fp32 params)."""
    return not (isinstance(master, tuple) and not master)


class DistributedOptimizer:
    """Steps the params with the reduced grad buckets: per leaf (replicated) or per bucket shard
    (distributed).

    Pure underneath: :meth:`init` and :meth:`step` run inside the DDP's ``shard_map`` and
    return new values; the object only holds static configuration.
    """

    def __init__(
        self,
        optimizer: optax.GradientTransformation | OptimizerConfig,
        specs: Sequence[BufferSpec],
        infos: Sequence[ParamInfo],
        state: ParallelState,
        ddp_config: DistributedDataParallelConfig,
        learning_rate: float | optax.Schedule | None = None,
        clip_grad: float | None = None,
    ):
        self.optimizer = optimizer
        self.specs = tuple(specs)
        self.flags = LeafFlags.build(self.specs, infos)
        self.state = state
        self.ddp_config = ddp_config
        self.learning_rate = learning_rate
        default_clip = optimizer.clip_grad if isinstance(optimizer, OptimizerConfig) else 0.0
        self.clip_grad = default_clip if clip_grad is None else clip_grad

    @property
    def sharded(self) -> bool:
        """Whether optimizer state is sharded over data parallelism."""
        return self.ddp_config.shards_optimizer_state

    def _tx(self, decay_mask: Any = None) -> optax.GradientTransformation:
        if isinstance(self.optimizer, OptimizerConfig):
            return get_optax_transformation(self.optimizer, self.learning_rate, decay_mask)
        return self.optimizer

    # -- shards ----------------------------------------------------------------------------
    def _intra_groups(self, spec: BufferSpec) -> list[list[int]] | None:
        """``axis_index_groups`` of the ranks sharing one copy of the state (None: the whole group)."""
        return distributed_optimizer_groups(spec, self.ddp_config, self.state)[0]

    def _shard_index(self, spec: BufferSpec) -> tuple[int, jax.Array]:
        """(g, this rank's shard among the g shards of each bucket): ``r mod g`` with several instances."""
        axes, groups = reduction_axes(spec, self.state), self._intra_groups(spec)
        return group_size(axes, groups), group_index(axes, groups)

    def _shard_range(self, spec: BufferSpec, bucket_size: int) -> tuple[jax.Array, int]:
        """(where this rank's shard starts in a bucket of ``bucket_size`` elements, the shard's size)."""
        shards, index = self._shard_index(spec)
        size = bucket_size // shards
        return index * size, size

    def _shard_flags(self, spec: BufferSpec, bucket: int, per_leaf: Sequence[bool]) -> jax.Array | bool:
        """A per-leaf flag (``per_leaf``: :class:`LeafFlags`' entry) over the elements of this
        rank's shard of ``bucket``: a bool, or a bool array where the shard may mix parameters
        with and without it. Computed from where the flag flips in the bucket
        (:func:`bucket_flag_changes`), not stored: stored per-element masks cost 3 bytes per
        element of every bucket on every device, three times the optimizer state itself at dp 8."""
        first, flips = bucket_flag_changes(spec, bucket, [per_leaf[i] for i in spec.leaves])
        if not flips:
            return first
        start, size = self._shard_start(spec, bucket)
        if len(flips) <= FLAG_COMPARE_MAX_FLIPS:  # one comparison each, fused into the update
            at = start + lax.iota(jnp.int32, size)  # each element's offset in the bucket
            passed = sum((at >= f).astype(jnp.int32) for f in flips)
        else:  # the flips before the shard, then a 1 at each flip inside it, summed up to each element
            inside = jnp.asarray(flips, jnp.int32) - start
            marks = jnp.zeros(size, jnp.int32).at[jnp.where(inside < 0, size, inside)].add(1, mode="drop")
            passed = jnp.sum(inside < 0) + jnp.cumsum(marks)  # (a negative index would wrap, not drop)
        return (passed % 2 == 1) != first

    def _param_shards(self, param_leaves: Sequence[jax.Array]) -> tuple[Buckets, ...]:
        """This rank's fp32 shard of every bucket of the params (never the whole buckets)."""
        out = []
        for spec in self.specs:
            shards, index = self._shard_index(spec)
            out.append(tuple(flatten_bucket_shard(param_leaves, spec, b, shards, index, jnp.float32)
                             for b in range(len(spec.layout.bucket_indices))))
        return tuple(out)

    # -- pure API --------------------------------------------------------------------------
    def init(self, param_leaves: Sequence[jax.Array]) -> dict[str, Any]:
        """Optimizer state for this rank: fp32 masters of non-fp32 params (per leaf, or this rank's
        bucket shards when distributed) and the optax state of the same values; with
        ``check_for_large_grads`` / ``check_for_spiky_loss`` also this rank's tracker of that
        check (``"large_grads"``, ``"spiky_loss"``)."""
        if self.sharded:
            shards = self._param_shards(param_leaves)
            master = tuple(s if spec.key.param_dtype != "float32" else ()
                           for spec, s in zip(self.specs, shards, strict=True))
            state = {"master": master, "inner": self._tx().init(shards)}
        else:
            master = tuple(p.astype(jnp.float32) if p.dtype != jnp.float32 else () for p in param_leaves)
            state = {"master": master, "inner": self._tx().init(self._current_leaves(master, param_leaves))}
        return {**state, **self._init_trackers()}

    def _init_trackers(self) -> dict[str, Any]:
        """The per-device trackers of the checks that are on (``large_grads``, ``spiky_loss``)."""
        trackers = {}
        if self.ddp_config.check_for_large_grads:
            trackers["large_grads"] = init_large_grad_tracker()
        if self.ddp_config.check_for_spiky_loss:
            trackers["spiky_loss"] = init_spiky_loss_tracker()
        return trackers

    def _local_param_shapes(self) -> list[jax.ShapeDtypeStruct]:
        shapes = {i: jax.ShapeDtypeStruct(shape, jnp.dtype(spec.key.param_dtype))
                  for spec in self.specs for i, shape in zip(spec.leaves, spec.shapes, strict=True)}
        return [shapes[i] for i in range(len(shapes))]

    def state_specs(self, param_specs: Sequence[P], device_local: P) -> Any:
        """``shard_map`` specs of the optimizer state (:meth:`init`'s tree).

        Distributed: every leaf is device-local, ``device_local`` (a leading axis of one entry
        per device; the shards differ on every rank). Replicated: the masters and the optax
        state's parameter-shaped leaves are global arrays split like their parameters
        (``param_specs``, flattened-tree order), the rest (step counts) replicated. A leading
        per-device axis there would make XLA copy the optimizer state after every update.
        """
        if self.sharded:
            return device_local
        shape = jax.eval_shape(self.init, self._local_param_shapes())
        master = tuple(spec if _has_master(m) else () for m, spec in zip(shape["master"], param_specs, strict=True))
        inner = optax.tree_utils.tree_map_params(self._tx(), lambda _, spec: spec, shape["inner"], list(param_specs),
                                                 transform_non_params=lambda _: P())
        specs = {"master": master, "inner": inner}
        for key in TRACKERS:  # every rank's own tracker
            if key in shape:
                specs[key] = device_local
        return specs

    def state_to_local(self, opt_state: Any) -> Any:
        """Inside ``shard_map``: the state as :meth:`step` takes it (drops the per-device axis of a
        distributed state, and of the trackers)."""
        if self.sharded:
            return jax.tree.map(lambda x: x[0], opt_state)
        return {k: jax.tree.map(lambda x: x[0], v) if k in TRACKERS else v for k, v in opt_state.items()}

    def state_from_local(self, opt_state: Any) -> Any:
        """Inverse of :meth:`state_to_local`."""
        if self.sharded:
            return jax.tree.map(lambda x: x[None], opt_state)
        return {k: jax.tree.map(lambda x: x[None], v) if k in TRACKERS else v for k, v in opt_state.items()}

    # -- the layout-independent form (checkpoints) -------------------------------------------
    def global_state_specs(self, param_specs: Sequence[P]) -> Any:
        """``shard_map`` specs of :meth:`state_to_global`'s form: the replicated optimizer's state
        (fp32 masters of non-fp32 params and optax's parameter-shaped leaves split like their
        parameters, step counts replicated), without the per-device trackers."""
        shapes = self._local_param_shapes()
        fp32 = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in shapes]
        inner = optax.tree_utils.tree_map_params(self._tx(), lambda _, spec: spec,
                                                 jax.eval_shape(self._tx().init, fp32), list(param_specs),
                                                 transform_non_params=lambda _: P())
        master = tuple(spec if x.dtype != jnp.float32 else () for x, spec in zip(shapes, param_specs, strict=True))
        return {"master": master, "inner": inner}

    def _bucket_shards_def(self) -> Any:
        return jax.tree.structure(tuple(tuple(0 for _ in s.layout.bucket_indices) for s in self.specs))

    def _is_leaf_list(self, x: Any) -> bool:
        """Whether ``x`` is a list of one value per parameter (an optax state's parameter-shaped part)."""
        return isinstance(x, list) and jax.tree.structure(x) == jax.tree.structure([0] * len(self.flags.decay))

    def state_to_global(self, opt_state: dict[str, Any], splits: Sequence[StorageSplit] | None = None
                        ) -> dict[str, Any]:
        """Inside ``shard_map``, on :meth:`state_to_local`'s value: the state as every parameter's
        values (its local shard under tp/pp), whatever the data-parallel layout, each cut by its
        parameter's entry of ``splits`` (None: whole). Distributed: every rank puts its part of a
        leaf (from its bucket shard) in an array of the leaf's shape, zeros elsewhere, and the
        split's reduce-scatter sums those into the blocks: in groups of :meth:`_group_budget`
        elements, one after the other, so no rank holds more than about one group's worth of
        temporaries (not whole buckets, nor the whole state)."""
        splits = tuple(splits) if splits is not None else (StorageSplit(),) * len(self.flags.decay)
        if not self.sharded:
            return self._map_param_leaves(lambda x, split: split.cut(x), opt_state, splits)
        before: list[jax.Array] = []  # the last group's results: the next group waits for them
        Piece = tuple[int, jax.Array, StorageSplit]  # (leaf, a chunk's values, the chunk's split)

        def convert(batch: list[Piece], spec: BufferSpec, blocks: dict[int, list[jax.Array]]) -> None:
            nonlocal before
            axes = reduction_axes(spec, self.state)
            before = reduce_pieces([p for _, p, _ in batch], [split for _, _, split in batch], axes)
            for (i, _, _), block in zip(batch, before, strict=True):
                blocks.setdefault(i, []).append(block)

        def leaves_of(per_spec: Sequence[Buckets]) -> list[Any]:
            # Params (in chunks when large) in groups of at most ``budget`` elements, one
            # collective per group and kind, each group after the one before: XLA would otherwise
            # convert every param at once and hold their temporaries together, the whole optimizer
            # state on every rank.
            leaves: list[Any] = [()] * len(self.flags.decay)
            blocks: dict[int, list[jax.Array]] = {}
            chunks_of: dict[int, list[Chunk]] = {}  # each leaf's chunks, in the order of its blocks
            for spec, shards in zip(self.specs, per_spec, strict=True):
                if not _has_master(shards):
                    continue
                batch: list[Piece] = []
                # One rank (dp 1): the shard is the bucket and each leaf a slice of it, which XLA
                # writes straight into the leaf (no collective, nothing to bound or order).
                one_rank = group_size(reduction_axes(spec, self.state)) == 1
                limit, budget = (None, np.inf) if one_rank else (CONVERT_CHUNK_ELEMENTS, self._group_budget())
                for b, shard in enumerate(shards):
                    for j in spec.layout.bucket_params(b):
                        split = splits[spec.leaves[j]]
                        if one_rank and split.dim < 0:
                            start, shape = self._param_start(spec, b, j), tuple(spec.shapes[j])
                            blocks[spec.leaves[j]] = [shard[start:start + int(np.prod(shape))].reshape(shape)]
                            continue
                        view, chunks = _chunks(spec.shapes[j], split, limit)
                        chunks_of[spec.leaves[j]] = chunks
                        for chunk in chunks:
                            shape = _chunk_shape(view, chunk)
                            if batch and sum(p.size for _, p, _ in batch) + int(np.prod(shape)) > budget:
                                convert(batch, spec, blocks)
                                batch = []
                            if len(chunks) == 1:  # the whole param in its own shape (compiles faster)
                                piece = self._leaf_piece(shard, spec, b, j, before)
                                batch.append((spec.leaves[j], piece, split))
                                continue
                            piece = self._leaf_piece(shard, spec, b, j, before, _positions(view, chunk), shape)
                            batch.append((spec.leaves[j], piece, _chunk_split(split)))
                convert(batch, spec, blocks)
                for j, i in enumerate(spec.leaves):
                    if i in blocks:  # the chunks' blocks, in order: the leaf's block
                        leaves[i] = _assemble(blocks.pop(i), chunks_of.get(i, []), splits[i], spec.shapes[j])
            return leaves

        is_shards = lambda x: jax.tree.structure(x) == self._bucket_shards_def()
        master = tuple(leaves_of(opt_state["master"]))
        inner = jax.tree.map(lambda x: leaves_of(x) if is_shards(x) else x, opt_state["inner"], is_leaf=is_shards)
        return {"master": master, "inner": inner}

    def state_from_global(self, global_state: dict[str, Any], splits: Sequence[StorageSplit] | None = None
                          ) -> dict[str, Any]:
        """Inverse of :meth:`state_to_global` (with the same ``splits``) in this optimizer's layout,
        inside ``shard_map``: each leaf is joined whole from its blocks, and when distributed each
        rank copies its part of it into its bucket shards, leaf by leaf. The trackers
        (``large_grads``, ``spiky_loss``) start afresh."""
        splits = tuple(splits) if splits is not None else (StorageSplit(),) * len(self.flags.decay)
        if not self.sharded:
            return {**self._map_param_leaves(lambda x, split: split.join(x), global_state, splits),
                    **self._init_trackers()}
        # One param after the other (each all-gathers its whole param, and XLA may transpose
        # it): all at once would hold the whole state on every rank. A load is rare: its memory
        # is what matters, not the number of collectives.
        last: list[jax.Array] = []

        def shards_of(leaves: Sequence[Any], spec: BufferSpec) -> Buckets:
            shards = []
            for b in range(len(spec.layout.bucket_indices)):
                shards.append(self._bucket_shard(leaves, splits, spec, b, last))
                last[:] = shards[-1:]
            return tuple(shards)

        inner = jax.tree.map(lambda x: tuple(shards_of(x, s) for s in self.specs) if self._is_leaf_list(x) else x,
                             global_state["inner"], is_leaf=self._is_leaf_list)
        master = list(global_state["master"])  # () for fp32 params, whose buffers keep no master
        master = tuple(shards_of(master, s) if s.key.param_dtype != "float32" else () for s in self.specs)
        return {"master": master, "inner": inner, **self._init_trackers()}

    def _map_param_leaves(self, f: Any, state: dict[str, Any], per_param: Sequence[Any]) -> dict[str, Any]:
        """Replicated: ``{"master", "inner"}`` of ``state`` with ``f(leaf, per_param[i])`` applied to
        every leaf of parameter ``i``'s shape (masters, optax's parameter-shaped leaves)."""
        inner = optax.tree_utils.tree_map_params(self._tx(), f, state["inner"], list(per_param))
        master = tuple(f(m, x) if _has_master(m) else m for m, x in zip(state["master"], per_param, strict=True))
        return {"master": master, "inner": inner}

    # -- one leaf between a bucket shard and the layout-independent form ----------------------
    def _shard_start(self, spec: BufferSpec, bucket: int) -> tuple[jax.Array, int]:
        """:meth:`_shard_range` of ``bucket`` of ``spec``."""
        start, end = spec.layout.bucket_indices[bucket]
        return self._shard_range(spec, end - start)

    @staticmethod
    def _param_start(spec: BufferSpec, bucket: int, j: int) -> int:
        """Where param ``j`` of ``spec`` starts in its bucket."""
        return spec.layout.param_index_map[j][0] - spec.layout.bucket_indices[bucket][0]

    def _group_budget(self) -> int:
        """Elements of a group of :meth:`state_to_global`'s conversion: the largest parameter's
        (its local shard) up to ``CONVERT_CHUNK_ELEMENTS`` (larger ones go in chunks), at least
        ``CONVERT_GROUP_MIN_ELEMENTS``."""
        largest = max(int(np.prod(shape)) for spec in self.specs for shape in spec.shapes)
        return max(min(largest, CONVERT_CHUNK_ELEMENTS), CONVERT_GROUP_MIN_ELEMENTS)

    def _leaf_piece(self, shard: jax.Array, spec: BufferSpec, bucket: int, j: int, after: list[Any],
                    positions: jax.Array | None = None, shape: tuple[int, ...] | None = None) -> jax.Array:
        """Param ``j``'s values that this rank's ``shard`` of ``bucket`` holds, in an array of the
        param's local shape, zeros elsewhere (and zeros on all but the first instance's copy),
        computed after the values ``after``. Summed over the data-parallel group they are the
        param's values, exactly. With ``positions`` and ``shape``: only the elements at those
        positions of the flattened param (a chunk, :func:`_positions`), in that shape."""
        shape = tuple(spec.shapes[j]) if shape is None else shape
        positions = jnp.arange(int(np.prod(shape, dtype=int))) if positions is None else positions
        shard_start, _ = self._shard_start(spec, bucket)
        first = _after(self._param_start(spec, bucket, j) - shard_start, after)
        piece = _read(shard, first + positions)
        if self._intra_groups(spec) is not None:  # several instances hold the shard: count one
            axes = reduction_axes(spec, self.state)
            piece = jnp.where(lax.axis_index(axes) < group_size(axes, self._intra_groups(spec)), piece, 0)
        return piece.reshape(shape)

    def _bucket_shard(self, leaves: Sequence[Any], splits: Sequence[StorageSplit], spec: BufferSpec, bucket: int,
                      after: list[jax.Array]) -> jax.Array:
        """Inverse of :meth:`_leaf_piece` for a whole bucket: this rank's shard, from the blocks of
        its params (``leaves``, cut by ``splits``), each joined whole (in chunks when large,
        :func:`_chunks`) after the one before (the first after the values ``after``) and
        written into the shard; zeros in the padding."""
        shard_start, size = self._shard_start(spec, bucket)
        shard = jnp.zeros(size, jnp.float32)
        for j in spec.layout.bucket_params(bucket):
            i, split = spec.leaves[j], splits[spec.leaves[j]]
            view, chunks = _chunks(spec.shapes[j], split, CONVERT_CHUNK_ELEMENTS)
            rows = leaves[i].reshape(view[0], -1, view[2])  # this rank's block, as the chunks see it
            ranks = group_size(split.axes) if split.dim >= 0 else 1
            for r0, r1, c0, c1 in chunks:
                if len(chunks) == 1:
                    # The same values, read only once ``after`` is done (a slice at offset 0 of the
                    # block with one more element: XLA cannot drop it as a whole-array slice).
                    longer = jnp.concatenate([rows.reshape(-1), jnp.zeros(1, rows.dtype)])
                    block = lax.dynamic_slice_in_dim(longer, _after(0, after), rows.size).reshape(rows.shape)
                else:
                    block = lax.dynamic_slice(rows, (_after(r0, after), 0, c0), (r1 - r0, rows.shape[1], c1 - c0))
                # Every rank's block of the chunk, flat, rank after rank (as gathered: no copy into
                # the parameter's order, or into the scatter's layout; the positions follow).
                stacked = all_gather(block.reshape(-1), split.axes, axis=0) if ranks > 1 else block.reshape(-1)
                # Each element to its place in the shard, those outside it nowhere: a scatter that
                # reads nothing of the shard, so XLA updates it in place (rewriting a window of
                # the shard, its kept part read back, would cost two copies of the shard). The indices,
                # as many as the chunk's elements, are computed after the chunk before too.
                begin = self._param_start(spec, bucket, j) - shard_start
                at = _after(begin, after) + _positions(view, (r0, r1, c0, c1), ranks)
                at = jnp.where(at < 0, size, at)  # before the shard: dropped (not wrapped, as -1 would be)
                shard = shard.at[at].set(stacked.astype(jnp.float32), mode="drop")
                after = [shard]  # it holds every chunk before the next one: waiting for it waits for them all
        return shard

    @staticmethod
    def _current_leaves(master: Sequence[Any], param_leaves: Sequence[jax.Array]) -> list[jax.Array]:
        return [m if _has_master(m) else p for m, p in zip(master, param_leaves, strict=True)]

    def _gather_buckets(self, shards: Buckets, spec: BufferSpec) -> Buckets:
        """Full buckets from this rank's updated shards: one all-gather per bucket with
        ``overlap_param_gather`` (each can overlap with compute on its own), else one per buffer."""
        axes = reduction_axes(spec, self.state)
        groups = self._intra_groups(spec)  # inside the instance with several instances
        if self.ddp_config.overlap_param_gather or len(shards) == 1:
            return tuple(all_gather(s, axes, axis_index_groups=groups) for s in shards)
        return _gather_all_buckets_at_once(shards, axes, groups)

    def _norm_axes(self, spec: BufferSpec) -> tuple[str, ...]:
        """Mesh axes a buffer's squared-norm contributions are summed over: every axis when
        distributed or sharded over data parallelism (each rank counts its shard); without the ones
        it is reduced over when replicated (every rank of the group counts its own identical copy).
        An FSDP-sharded buffer under HSDP is replicated over the outer data-parallel axis (one copy per
        distributed-optimizer instance): summed over every axis but that one."""
        axes = tuple(self.state.mesh.axis_names)
        if self.sharded:  # every rank holds its own shard
            return axes
        if spec.key.fsdp_sharded:  # every rank of an instance holds its own shard
            return tuple(a for a in axes if a not in self.state.data_parallel_outer_axis_name)
        replicated_over = reduction_axes(spec, self.state)
        return tuple(a for a in axes if a not in replicated_over)

    def grad_norm(self, grads: Sequence[Buckets] | Sequence[jax.Array]) -> jax.Array:
        """Global L2 norm of the reduced gradients across every rank (see ``clip_grads``).

        ``grads``: this rank's bucket shards when distributed, the per-leaf reduced gradients
        when replicated. Non-finite elements make the norm non-finite even where this
        device does not count them (0/1 weights multiply)."""
        sumsq: dict[tuple[str, ...], list[jax.Array]] = {}

        def add(spec, g, tp_split, pp_split):
            w = bucket_norm_weights(tp_split, pp_split, self.state).astype(jnp.float32)
            g32 = g.astype(jnp.float32)
            if self.sharded and self._intra_groups(spec) is not None:
                # Several instances hold copies of this shard: count instance 0's (a 0 weight
                # multiplies, so a NaN in another copy still shows).
                axes = reduction_axes(spec, self.state)
                w = w * (lax.axis_index(axes) < group_size(axes, self._intra_groups(spec))).astype(jnp.float32)
            sumsq.setdefault(self._norm_axes(spec), []).append(jnp.sum(w * (g32 * g32)))

        if self.sharded:
            for spec, shards in zip(self.specs, grads, strict=True):
                for b, g in enumerate(shards):
                    add(spec, g, self._shard_flags(spec, b, self.flags.tp_split),
                        self._shard_flags(spec, b, self.flags.pp_split))
        else:
            for spec in self.specs:
                for i in spec.leaves:
                    add(spec, grads[i], self.flags.tp_split[i], self.flags.pp_split[i])
        return get_grad_norm_fp32(sumsq, self.state)

    def step(
        self, opt_state: dict[str, Any], reduced: Sequence[Any], param_leaves: Sequence[jax.Array],
        skip_nonfinite: bool = False, skip: jax.Array | None = None,
    ) -> tuple[dict[int, jax.Array], dict[str, Any], jax.Array, jax.Array]:
        """Clip, step, gather. ``reduced`` is what ``finalize_model_grads`` returns (every leaf's
        reduced gradient, or this rank's bucket shards when distributed). Returns ({leaf index:
        new param}, new state, grad norm, skipped).

        With ``skip_nonfinite`` a non-finite global grad norm (a NaN or Inf in any rank's
        gradients; the norm is the same on every rank) leaves params and state unchanged and
        ``skipped`` is true; so does a true ``skip`` (a scalar, the same on every rank: the
        ``check_for_large_grads`` verdict of :meth:`check_large_grads`). The update is selected
        in a ``lax.cond``: a ``jnp.where`` between old and new values makes XLA recompute the new
        moments inside the parameter update and copy the old ones first. The conditional costs
        one copy of the updated params and state into their donated buffers. The clipping
        factor is applied inside the update, where XLA fuses it into the optimizer's loops
        instead of writing clipped copies of the gradients.
        """
        if self.sharded:
            current = self._param_shards(param_leaves)
            current = tuple(m if m else c for m, c in zip(opt_state["master"], current, strict=True))
            decay = tuple(tuple(self._shard_flags(s, b, self.flags.decay) for b in range(len(s.layout.bucket_indices)))
                          for s in self.specs)
        else:
            current = self._current_leaves(opt_state["master"], param_leaves)
            decay = list(self.flags.decay)
        grad_norm = self.grad_norm(reduced)
        if skip_nonfinite:
            skip = ~jnp.isfinite(grad_norm) if skip is None else skip | ~jnp.isfinite(grad_norm)
        coef = clip_coefficient(grad_norm, self.clip_grad) if self.clip_grad > 0 else jnp.ones((), jnp.float32)

        def update(operands):
            reduced, coef, inner, current = operands
            grads = jax.tree.map(lambda g: g.astype(jnp.float32) * coef, reduced)
            updates, inner = self._tx(decay).update(grads, inner, current)
            return optax.apply_updates(current, updates), inner

        operands = (reduced, coef, opt_state["inner"], current)
        if skip is None:
            new_values, inner = update(operands)
        else:
            new_values, inner = lax.cond(skip, lambda ops: (ops[3], ops[2]), update, operands)
        master = tuple(v if _has_master(m) else () for m, v in zip(opt_state["master"], new_values, strict=True))
        skipped = jnp.zeros((), bool) if skip is None else skip
        new_state = {**opt_state, "master": master, "inner": inner}  # keeps the trackers
        if not self.sharded:
            new_leaves = {i: v.astype(p.dtype) for i, (v, p) in enumerate(zip(new_values, param_leaves, strict=True))}
            return new_leaves, new_state, grad_norm, skipped
        new_leaves: dict[int, jax.Array] = {}
        for spec, shards in zip(self.specs, new_values, strict=True):
            # Gather in the param dtype, as Megatron gathers param_data (bf16).
            shards = tuple(s.astype(jnp.dtype(spec.key.param_dtype)) for s in shards)
            new_leaves.update(unflatten_from_buckets(self._gather_buckets(shards, spec), spec))
        return new_leaves, new_state, grad_norm, skipped

    def check_large_grads(self, opt_state: dict[str, Any], grad_leaves: Sequence[jax.Array]
                          ) -> tuple[dict[str, Any], dict[str, jax.Array], jax.Array]:
        """``check_for_large_grads`` on this rank's local grads before any collective (see
        :func:`core.distributed.grad_sync.check_for_large_grads`): returns the state with the
        updated tracker, this rank's report (``flags``/``norms`` per bucket, ``max``) and the skip
        verdict for :meth:`step` (any bucket on any rank flagged)."""
        tracker, report, any_large = check_for_large_grads(opt_state["large_grads"], grad_leaves, self.specs,
                                                           self.state)
        return {**opt_state, "large_grads": tracker}, report, any_large


Chunk = tuple[int, int, int, int]
"""Rows ``[r0, r1)`` and columns ``[c0, c1)`` of a parameter's ``[R, D, T]`` view (:func:`_chunks`)."""


def _chunks(shape: Sequence[int], split: StorageSplit, limit: int | None
            ) -> tuple[tuple[int, int, int], list[Chunk]]:
    """``(view, chunks)``: a parameter of local ``shape`` seen as ``view = (R, D, T)`` (``D`` the
    dimension ``split`` cuts, ``R`` and ``T`` the products of the dimensions before and after it;
    unsplit: ``D = 1``, ``T`` the last dimension), and the chunks of at most ``limit`` elements
    (whole rows where one fits, else parts of one row, at least one column) that the
    conversions handle one after the other (``limit`` None: one chunk, the whole parameter).
    Each chunk has all of ``D``, so the split joins or reduces it along its dimension 1 alone
    (:func:`_chunk_split`)."""
    if split.dim >= 0:
        view = (int(np.prod(shape[:split.dim], dtype=int)), shape[split.dim],
                int(np.prod(shape[split.dim + 1:], dtype=int)))
    else:
        view = (int(np.prod(shape[:-1], dtype=int)), 1, shape[-1] if len(shape) else 1)
    rows, depth, cols = view
    if limit is None:
        return view, [(0, rows, 0, cols)]
    if depth * cols <= limit:
        step = max(1, limit // (depth * cols))
        return view, [(r, min(r + step, rows), 0, cols) for r in range(0, rows, step)]
    step = max(1, limit // depth)
    return view, [(r, r + 1, c, min(c + step, cols)) for r in range(rows) for c in range(0, cols, step)]


def _chunk_shape(view: tuple[int, int, int], chunk: Chunk) -> tuple[int, int, int]:
    """The shape of ``chunk`` of the whole parameter's ``view``."""
    r0, r1, c0, c1 = chunk
    return (r1 - r0, view[1], c1 - c0)


def _positions(view: tuple[int, int, int], chunk: Chunk, parts: int = 1) -> jax.Array:
    """Where ``chunk``'s elements lie in the flattened parameter, for the elements in the order of
    ``[parts, r1 - r0, D / parts, c1 - c0]`` (row-major; ``parts``: the blocks of ``D`` that the
    ranks of the storage split hold, rank after rank). Computed on the device from iotas: no
    constant as large as the chunk."""
    rows, depth, cols = view
    r0, r1, c0, c1 = chunk
    if parts == 1 and (c0, c1) == (0, cols):  # whole rows: contiguous
        return r0 * depth * cols + jnp.arange((r1 - r0) * depth * cols)
    shape = (parts, r1 - r0, depth // parts, c1 - c0)
    k, r, d, c = (lax.broadcasted_iota(jnp.int32, shape, n) for n in range(4))
    return (((r0 + r) * depth + k * (depth // parts) + d) * cols + c0 + c).reshape(-1)


def _chunk_split(split: StorageSplit) -> StorageSplit:
    """``split`` for a chunk of :func:`_chunks` (its dimension 1, or none)."""
    return StorageSplit(split.spec, 1 if split.dim >= 0 else -1, split.axes)


def _assemble(parts: Sequence[jax.Array], chunks: Sequence[Chunk], split: StorageSplit,
              shape: Sequence[int]) -> jax.Array:
    """A leaf's block (of local ``shape``, cut by ``split``) from its chunks' blocks, each of its
    chunk's shape (:func:`_chunk_shape`, cut); a single part is the block itself, in its shape."""
    if len(parts) == 1:
        return parts[0]
    # Each chunk's block written in place as it comes (a concatenation would wait for all).
    whole = jnp.zeros((chunks[-1][1], parts[0].shape[1], chunks[-1][3]), parts[0].dtype)
    for (r0, _, c0, _), part in zip(chunks, parts, strict=True):
        whole = lax.dynamic_update_slice(whole, part, (r0, 0, c0))
    if split.dim < 0:
        return whole.reshape(shape)
    return whole.reshape(*shape[:split.dim], whole.shape[1], *shape[split.dim + 1:])


def _read(x: jax.Array, at: jax.Array) -> jax.Array:
    """``x[at]`` of a 1-D ``x``, zero where ``at`` is outside ``[0, x.size)`` (no wrapping)."""
    inside = (at >= 0) & (at < x.size)
    return jnp.where(inside, x[jnp.clip(at, 0, x.size - 1)], jnp.zeros((), x.dtype))


def _after(index: Any, values: Sequence[jax.Array]) -> Any:
    """``index`` (an integer), computed only once every array of ``values`` is: the same value,
    ``min(index, index + number of NaN first elements)``. ``lax.optimization_barrier`` does not
    order anything on XLA's CPU backend (its CSE-barrier pass just drops it); a value does."""
    firsts = [jnp.isnan(v.reshape(-1)[0]).astype(jnp.int32) for v in values if v.size]
    return jnp.minimum(index, index + sum(firsts)) if firsts else index


def _gather_all_buckets_at_once(shards: Buckets, axes: tuple[str, ...],
                                groups: list[list[int]] | None = None) -> Buckets:
    """One all-gather for a whole buffer: concatenate the bucket shards, gather, re-split."""
    sizes = [s.shape[0] for s in shards]
    gathered = all_gather(jnp.concatenate(shards), axes, axis_index_groups=groups).reshape(-1, sum(sizes))
    offsets = np.cumsum([0, *sizes])
    return tuple(gathered[:, a:b].reshape(-1) for a, b in zip(offsets[:-1], offsets[1:], strict=True))


def optimizer_state_bytes(opt_state: Any) -> int:
    """Bytes of optimizer state (master params + optax state) held by one device."""
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(opt_state)))
