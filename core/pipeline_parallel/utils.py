"""Layer partitioning over pipeline stages (Megatron's ``get_num_layers_to_build`` / layer offset)
and splitting a batch into microbatches."""

from __future__ import annotations

from typing import Any

import jax


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """Every ``[b, ...]`` leaf of ``batch`` as ``[num_microbatches, b / num_microbatches, ...]``."""
    m = num_microbatches
    return jax.tree.map(lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:]), batch)


def get_num_layers_to_build(num_layers: int, pipeline_model_parallel_size: int,
                            virtual_pipeline_model_parallel_size: int | None = None) -> int:
    """Layers per model chunk: ``num_layers / (pp * vpp)``; raises when it does not divide."""
    vpp = virtual_pipeline_model_parallel_size or 1
    if vpp > 1 and pipeline_model_parallel_size < 2:
        raise ValueError(f"virtual_pipeline_model_parallel_size {vpp} needs pipeline_model_parallel_size >= 2, "
                         f"got {pipeline_model_parallel_size}")
    chunks = pipeline_model_parallel_size * vpp
    if num_layers % chunks:
        raise ValueError(f"num_layers {num_layers} is not divisible by pipeline_model_parallel_size "
                         f"{pipeline_model_parallel_size} x virtual_pipeline_model_parallel_size {vpp} = {chunks}")
    return num_layers // chunks


def get_layer_offset(num_layers: int, pipeline_rank: int, pipeline_model_parallel_size: int,
                     virtual_rank: int = 0, virtual_pipeline_model_parallel_size: int | None = None) -> int:
    """First global layer of chunk ``virtual_rank`` on ``pipeline_rank`` (Megatron's interleaved layout:
    chunk c of rank r is virtual stage ``c * pp + r``)."""
    per = get_num_layers_to_build(num_layers, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size)
    return (virtual_rank * pipeline_model_parallel_size + pipeline_rank) * per
