"""Tensor (and sequence) parallelism: Megatron's mappings and layers, vocab-parallel cross
entropy, RNG streams, and the xlstm_jax TP API (TPDense, TPAsyncDense, ring collectives)."""

from core.tensor_parallel.async_collectives import (
    async_gather,
    async_gather_bidirectional,
    async_gather_split,
    async_scatter,
    async_scatter_split,
)
from core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from core.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from core.tensor_parallel.random import (
    data_parallel_rng,
    model_parallel_rng,
    sequence_parallel_dropout,
    tensor_parallel_init,
)
from core.tensor_parallel.tp_dense import ModelParallelismWrapper, TPAsyncDense, TPDense, scale_init
from core.tensor_parallel.utils import VocabUtility, divide, split_tensor_along_last_dim

__all__ = [
    "ColumnParallelLinear", "ModelParallelismWrapper", "RowParallelLinear", "TPAsyncDense", "TPDense",
    "VocabParallelEmbedding", "VocabUtility", "all_gather_last_dim_from_tensor_parallel_region", "async_gather",
    "async_gather_bidirectional", "async_gather_split", "async_scatter", "async_scatter_split",
    "copy_to_tensor_model_parallel_region", "data_parallel_rng", "divide", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "model_parallel_rng", "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region", "reduce_scatter_to_sequence_parallel_region", "scale_init",
    "scatter_to_sequence_parallel_region", "scatter_to_tensor_model_parallel_region", "sequence_parallel_dropout",
    "split_tensor_along_last_dim",
    "tensor_parallel_init", "vocab_parallel_cross_entropy",
]
