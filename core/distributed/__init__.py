"""Data parallelism, Megatron's names: ``DistributedDataParallel`` with its config, bucketed
gradient buffers, ``finalize_model_grads``, the package's collectives, and the xlstm_jax API
(FSDP: ``shard_module_params``, ``sync_gradients``; the tutorial's ``fold_rng_over_axis``,
``TrainState``, ``accumulate_gradients``)."""

from core.distributed.array_utils import fold_rng_over_axis, split_array_over_mesh, stack_params, unstack_params
from core.distributed.collectives import all_gather, all_reduce, reduce_scatter
from core.distributed.data_parallel import (
    gather_array_with_mean_grads,
    gather_params,
    shard_module_params,
    shard_params,
    sync_gradients,
)
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.finalize_model_grads import (
    allreduce_model_parallel_grads,
    finalize_model_grads,
    reduce_model_grads,
)
from core.distributed.single_gpu import (
    Batch,
    TrainState,
    accumulate_gradients,
    accumulate_gradients_loop,
    accumulate_gradients_scan,
)

__all__ = [
    "Batch", "DistributedDataParallel", "DistributedDataParallelConfig", "TrainState", "accumulate_gradients",
    "accumulate_gradients_loop", "accumulate_gradients_scan", "all_gather", "all_reduce",
    "allreduce_model_parallel_grads", "finalize_model_grads", "fold_rng_over_axis", "gather_array_with_mean_grads",
    "gather_params", "reduce_model_grads", "reduce_scatter", "shard_module_params", "shard_params",
    "split_array_over_mesh", "stack_params", "sync_gradients", "unstack_params",
]
