"""Layer partitioning over pipeline stages (Megatron's ``get_num_layers_to_build`` / layer offset),
the placement of model chunks on pipeline ranks, and splitting a batch into microbatches."""

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


INTERLEAVED_PLACEMENT = "interleaved"
"""Megatron's interleaved placement: chunk ``c`` of rank ``r`` is virtual stage ``c * pp + r``."""
V_PLACEMENT = "v"
"""ZB-V's V placement (two chunks): chunk 0 of rank ``r`` is virtual stage ``r``, chunk 1 is
``2 pp - 1 - r`` (the first and last virtual stages both sit on rank 0)."""


def chunk_placement(pipeline_schedule: str | None) -> str:
    """The chunk placement a pipeline schedule runs on: :data:`V_PLACEMENT` for ``"zb-v"``, else
    :data:`INTERLEAVED_PLACEMENT`."""
    return V_PLACEMENT if pipeline_schedule == "zb-v" else INTERLEAVED_PLACEMENT


def virtual_stage(placement: str, pipeline_model_parallel_size: int, pipeline_rank: Any, chunk: Any) -> Any:
    """Virtual stage of ``chunk`` on ``pipeline_rank`` under ``placement`` (ints or traced arrays).
    With one chunk per rank (or pp 1) the placements coincide."""
    pp = pipeline_model_parallel_size
    if placement == INTERLEAVED_PLACEMENT:
        return chunk * pp + pipeline_rank
    if placement != V_PLACEMENT:
        raise ValueError(f"unknown chunk placement {placement!r}")
    return pipeline_rank + chunk * (2 * pp - 1 - 2 * pipeline_rank)  # chunk 1: 2pp - 1 - rank


def get_layer_offset(num_layers: int, pipeline_rank: int, pipeline_model_parallel_size: int,
                     virtual_rank: int = 0, virtual_pipeline_model_parallel_size: int | None = None) -> int:
    """First global layer of chunk ``virtual_rank`` on ``pipeline_rank`` (Megatron's interleaved layout:
    chunk c of rank r is virtual stage ``c * pp + r``)."""
    per = get_num_layers_to_build(num_layers, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size)
    return (virtual_rank * pipeline_model_parallel_size + pipeline_rank) * per
