"""Explicit parallelism metadata of parameters, carried by flax's boxed-variable mechanism.

Megatron tags parameters with ad-hoc attributes (``tensor_model_parallel``,
``partition_dim``, ``sequence_parallel``, ``shared_embedding``, ``allreduce``). Here a layer
declares them once, when it creates the parameter, by wrapping its initializer with
:func:`with_parallel_metadata`. The value is then boxed in :class:`ParallelPartitioned`, a
``flax.linen.Partitioned`` whose ``names`` give the mesh axis each dimension is split over
(so ``nn.get_partition_spec`` works as usual) plus the Megatron flags.

Everything downstream (DDP buckets, ``finalize_model_grads``, checkpoints) reads a plain
tree of :class:`ParamInfo` built by :func:`param_info_tree`, never attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import struct
from jax.sharding import PartitionSpec


class ParallelPartitioned(nn.Partitioned):
    """A ``nn.Partitioned`` box that also records Megatron's per-parameter flags."""

    sequence_parallel: bool = struct.field(pytree_node=False, default=False)
    """Replicated over tp but fed by sequence-sharded activations: grads all-reduced over tp."""
    shared_embedding: bool = struct.field(pytree_node=False, default=False)
    """Word embedding tied between first and last pipeline stage (own DDP bucket, embd all-reduce)."""
    expert: bool = struct.field(pytree_node=False, default=False)
    """Expert parameter: reduced over the expert-data-parallel group, not the dense one."""
    tp_partial_grad: bool = struct.field(pytree_node=False, default=False)
    """Replicated over tp but applied to this rank's share of the heads (the q/k norms): grads
    all-reduced over tp with or without sequence parallelism."""

    def unbox(self, apply_constraint: bool = True) -> Any:
        """The raw value. Layers run inside ``shard_map`` on local shards, where a sharding
        constraint is meaningless (and rejected for manual axes); the specs are applied by
        ``shard_map``'s ``in_specs``/``out_specs`` instead."""
        del apply_constraint
        return self.value


def with_parallel_metadata(
    init_fn: Callable[..., Any],
    names: Sequence[str | None],
    *,
    sequence_parallel: bool = False,
    shared_embedding: bool = False,
    expert: bool = False,
    tp_partial_grad: bool = False,
) -> Callable[..., ParallelPartitioned]:
    """Wrap a flax initializer so the parameter it creates carries parallel metadata.

    ``names[d]`` is the mesh axis dimension ``d`` is split over (e.g. ``("tp", None)`` for a
    weight split along dim 0 over tensor parallelism), ``None`` for an unsplit dimension.
    """

    def wrapped(*args: Any, **kwargs: Any) -> ParallelPartitioned:
        return ParallelPartitioned(
            init_fn(*args, **kwargs),
            tuple(names),
            sequence_parallel=sequence_parallel,
            shared_embedding=shared_embedding,
            expert=expert,
            tp_partial_grad=tp_partial_grad,
        )

    return wrapped


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """Everything the parallel machinery needs to know about one parameter."""

    partition_spec: PartitionSpec
    """Mesh axis per dimension (``PartitionSpec()`` for a replicated parameter)."""
    sequence_parallel: bool = False
    """Grad must be all-reduced over tp (sequence-parallel norms, row-parallel bias)."""
    shared_embedding: bool = False
    """Tied word embedding / output weight shared by first and last pipeline stage."""
    expert: bool = False
    """Expert parameter (reduced over expert-data-parallel ranks)."""
    tp_partial_grad: bool = False
    """Replicated over tp, each rank's grad covers only its heads (q/k norms): all-reduced over tp."""
    fsdp_dim: int = -1
    """Dimension also split over ``fsdp_axes`` at rest (Megatron-FSDP ``optim_grads_params``): the
    model all-gathers it before use and the gather's transpose reduce-scatters its grad; -1: none."""
    fsdp_axes: tuple[str, ...] = ()
    """The data-parallel mesh axes ``fsdp_dim`` is split over (major first; empty when not split)."""

    @property
    def fsdp_sharded(self) -> bool:
        """Whether the parameter is sharded over data parallelism at rest (``fsdp_dim``)."""
        return self.fsdp_dim >= 0

    @property
    def grad_summed_over_tp(self) -> bool:
        """Whether each tp rank's grad is a partial sum (``sequence_parallel`` or ``tp_partial_grad``)."""
        return self.sequence_parallel or self.tp_partial_grad

    def split_over(self, axis: str) -> bool:
        """Whether some dimension of the parameter is split over mesh axis ``axis``."""
        return any(_names_axis(n, axis) for n in self.partition_spec)

    @property
    def tensor_model_parallel(self) -> bool:
        """Whether the parameter is split over the tensor-parallel axis."""
        return self.split_over("tp")

    @property
    def partition_dim(self) -> int | None:
        """The dimension split over tp, or None (Megatron's ``partition_dim``)."""
        for dim, n in enumerate(self.partition_spec):
            if _names_axis(n, "tp"):
                return dim
        return None


def _names_axis(entry: Any, axis: str) -> bool:
    return entry == axis or (isinstance(entry, tuple) and axis in entry)


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _info(leaf: Any) -> ParamInfo:
    if isinstance(leaf, nn.Partitioned):
        info = ParamInfo(PartitionSpec(*leaf.names))
        if isinstance(leaf, ParallelPartitioned):
            info = dataclasses.replace(
                info,
                sequence_parallel=leaf.sequence_parallel,
                shared_embedding=leaf.shared_embedding,
                expert=leaf.expert,
                tp_partial_grad=leaf.tp_partial_grad,
            )
        return info
    return ParamInfo(PartitionSpec())


def param_info_tree(boxed: Any) -> Any:
    """Tree of :class:`ParamInfo`, one per parameter of a boxed variable tree.

    Unboxed leaves (plain arrays) are taken as replicated with no flags.
    """
    return jax.tree.map(_info, boxed, is_leaf=_is_box)


def unbox(boxed: Any) -> Any:
    """Strip the metadata boxes, without sharding constraints (safe inside ``shard_map``)."""
    return jax.tree.map(lambda x: x.value if _is_box(x) else x, boxed, is_leaf=_is_box)


def abstract_boxed_params(init_fn: Callable[..., Any], mesh: jax.sharding.Mesh, args: Sequence[Any],
                          in_specs: Sequence[PartitionSpec]) -> Any:
    """The boxed local parameters ``init_fn(*args)`` would create inside ``shard_map``, as
    ``jax.ShapeDtypeStruct`` leaves with their metadata (nothing allocated): what
    :func:`param_info_tree` reads the partition specs from."""
    fn = jax.shard_map(init_fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=PartitionSpec(), check_vma=False)
    return jax.eval_shape(fn, *args)


def init_sharded_params(init_fn: Callable[..., Any], mesh: jax.sharding.Mesh, args: Sequence[Any],
                        in_specs: Sequence[PartitionSpec],
                        refine: Callable[[ParamInfo, tuple[int, ...]], ParamInfo] | None = None,
                        abstract: bool = False, prepare: Callable[[Any], None] | None = None
                        ) -> tuple[Any, Any, Any]:
    """Initialise parameters inside ``shard_map`` as global arrays sharded as their metadata says.

    ``init_fn(*args)`` (e.g. ``module.init``) runs on local shards and creates local parameter
    shapes. A first abstract pass reads the metadata; the real pass returns global arrays with
    those partition specs. ``refine(info, local_shape)`` may add an FSDP split to a parameter's
    info (:attr:`ParamInfo.fsdp_dim`): each rank then keeps only its block of the value it
    created, inside the same program, so no device ever returns more than its shard;
    ``prepare(infos)`` runs between the abstract pass and the real one (a module that creates its
    parameters unit by unit can then keep each unit's blocks as it goes, so no device holds more
    than one unit whole: what it returns already cut is not cut again). With
    ``abstract`` nothing is computed: the params are ``jax.ShapeDtypeStruct`` leaves with their
    global shapes and shardings (what ``jit(...).lower`` takes to compile a step for a model too
    large to allocate here). Returns ``(params, partition_spec_tree, param_info_tree)``.
    """
    boxed = abstract_boxed_params(init_fn, mesh, args, in_specs)
    infos = param_info_tree(boxed)
    whole = jax.tree.map(lambda x: tuple(x.shape), unbox(boxed))
    if refine is not None:
        infos = jax.tree.map(lambda i, shape: refine(i, shape), infos, whole, is_leaf=lambda x: isinstance(x, tuple))
    specs = jax.tree.map(lambda i: i.partition_spec, infos)
    if prepare is not None:
        prepare(infos)

    def init(*a):
        cut = lambda x, info, shape: keep_fsdp_block(x, info) if x.shape == shape else x
        return jax.tree.map(cut, unbox(init_fn(*a)), infos, whole, is_leaf=lambda x: isinstance(x, tuple))

    program = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=tuple(in_specs), out_specs=specs, check_vma=False))
    if not abstract:
        return program(*args), specs, infos
    place = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
    return jax.tree.map(place, jax.eval_shape(program, *args), specs), specs, infos


def keep_fsdp_block(x: jax.Array, info: ParamInfo, stacked: int = 0) -> jax.Array:
    """Inside ``shard_map``: this rank's block of a whole (model-parallel-local) parameter along its
    FSDP dimension (``x`` without the parameter's first ``stacked`` dimensions, e.g. one layer of
    a ``[vpp, L, ...]`` stack: 2); ``x`` itself when the parameter is not FSDP-sharded."""
    if not info.fsdp_sharded:
        return x
    dim = info.fsdp_dim - stacked
    size = x.shape[dim] // jax.lax.axis_size(info.fsdp_axes)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(info.fsdp_axes) * size, size, dim)
