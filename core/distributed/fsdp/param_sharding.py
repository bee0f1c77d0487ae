"""Which dimension of a parameter Megatron-FSDP ``optim_grads_params`` (ZeRO-3) shards over data parallelism.

One rule for every parameter, read from its :class:`~core.param_metadata.ParamInfo`: the
parameter is split over the data-parallel axes that hold copies of it (dp, ep and cp for a
dense parameter; dp and cp for an expert parameter, whose ``ep`` dimension is split already,
Megatron's expert-data-parallel group) along its first dimension that

* comes after the stacked-layer dimensions (``[vpp, L, ...]``, the dimension split over
  ``"pp"`` and the ones before it: a unit is one layer, sliced out of the stack before its
  gather),
* is not split over a model-parallel axis already, and
* divides evenly by the group's size.

The first such dimension, not the last, so each layer's gather concatenates contiguous blocks
(an all-gather along a leading dimension needs no transpose). A parameter without one (a
bias split over tp, a dimension the group does not divide) stays whole on every data-parallel
rank and is reduced by the bucketed all-reduce, as with ``no_shard``.

HSDP (``num_distributed_optimizer_instances`` = N > 1): the split is over those axes minus the outer
data-parallel axis ``"dpo"`` (:attr:`~core.parallel_state.ParallelState.data_parallel_outer_axis_name`),
i.e. inside one distributed-optimizer instance; the N instances hold copies of the shards.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from core.distributed.storage_split import first_unstacked_dim
from core.parallel_state import ParallelState
from core.param_metadata import ParamInfo


def shard_over_data_parallel(info: ParamInfo, local_shape: tuple[int, ...], state: ParallelState) -> ParamInfo:
    """``info`` with the FSDP split of the module docstring's rule (``fsdp_dim``, ``fsdp_axes`` and
    the partition spec naming them), or unchanged when the parameter has no such dimension.
    ``local_shape``: the parameter's shape on one device before the split (model-parallel local)."""
    outer = state.data_parallel_outer_axis_name  # HSDP: replicated across instances
    axes = tuple(a for a in state.replica_axes(info.expert) if state.mesh.shape[a] > 1 and a not in outer)
    size = 1
    for a in axes:
        size *= state.mesh.shape[a]
    if size == 1:
        return info
    entries = list(info.partition_spec) + [None] * (len(local_shape) - len(info.partition_spec))
    for dim in range(first_unstacked_dim(info.partition_spec), len(local_shape)):
        if entries[dim] is None and local_shape[dim] % size == 0 and local_shape[dim] >= size:
            entries[dim] = axes if len(axes) > 1 else axes[0]
            return dataclasses.replace(info, partition_spec=P(*entries), fsdp_dim=dim, fsdp_axes=axes)
    return info
