"""Pipeline schedule tables (pure Python): which microbatch, model chunk and direction each
pipeline rank processes at each of its steps, following Megatron-core's schedules.

* 1F1B without interleaving (:func:`get_pipeline_parallel_order`): ``min(pp - rank - 1, M)``
  warm-up forwards, then one-forward-one-backward, then the remaining backwards.
* Interleaved 1F1B: ``M * vpp`` virtual microbatches ordered by :func:`get_schedule_table`
  (microbatch groups of ``microbatch_group_size_per_vp_stage``, every chunk of a group before
  the next group); forwards visit chunks in order, backwards in reverse chunk order; warm-up
  ``(pp - rank - 1) * 2 + (vpp - 1) * group`` (all of them when ``M == pp``).

These tables drive the SPMD executors and are what the tests check (every forward before its
backward, in-flight counts never negative, Megatron's example tables).
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class Step:
    """One unit of work of a pipeline rank."""

    kind: Literal["F", "B"]
    """Forward or backward."""
    microbatch: int
    """Microbatch index in ``[0, M)``."""
    chunk: int = 0
    """Model chunk (virtual stage) on this rank, ``[0, vpp)``."""


def check_interleaving(num_microbatches: int, pipeline_parallel_size: int, virtual_size: int | None,
                       group_size: int | None = None) -> int:
    """Validate an interleaved configuration; returns the microbatch group size."""
    if virtual_size is None or virtual_size == 1:
        return num_microbatches
    if pipeline_parallel_size < 2:
        raise ValueError(
            f"the interleaved schedule needs pipeline_model_parallel_size >= 2, got {pipeline_parallel_size}")
    group = pipeline_parallel_size if group_size is None else group_size
    if not pipeline_parallel_size <= group <= num_microbatches:
        raise ValueError(
            f"microbatch_group_size_per_vp_stage ({group}) must lie in [pipeline_model_parallel_size "
            f"({pipeline_parallel_size}), num_microbatches ({num_microbatches})]")
    rest = num_microbatches % group
    if rest and rest < pipeline_parallel_size:
        raise ValueError(
            f"num_microbatches ({num_microbatches}) modulo the microbatch group size ({group}) is {rest}: it must be 0 "
            f"or at least pipeline_model_parallel_size ({pipeline_parallel_size})")
    return group


def get_schedule_table(num_microbatches: int, num_model_chunks: int,
                       microbatch_group_size_per_vp_stage: int) -> list[tuple[int, int]]:
    """Megatron's ``(microbatch, chunk)`` order of the virtual microbatches (interleaved)."""
    table = []
    group = microbatch_group_size_per_vp_stage
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in range(first, last))
    return table


def get_pipeline_parallel_order(num_microbatches: int, pipeline_parallel_size: int, rank: int,
                                virtual_size: int | None = None, group_size: int | None = None,
                                forward_only: bool = False) -> list[Step]:
    """The ordered steps of pipeline ``rank`` (1F1B, or interleaved 1F1B when ``virtual_size > 1``)."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    vpp = virtual_size or 1
    group = check_interleaving(num_microbatches, pipeline_parallel_size, virtual_size, group_size)
    table = get_schedule_table(num_microbatches, vpp, group)
    total = len(table)
    forwards = [Step("F", mb, chunk) for mb, chunk in table]
    backwards = [Step("B", mb, vpp - 1 - chunk) for mb, chunk in table]
    if forward_only:
        return forwards
    if vpp == 1:
        warmup = min(pipeline_parallel_size - rank - 1, num_microbatches)
    elif num_microbatches == pipeline_parallel_size:
        warmup = total
    else:
        warmup = min((pipeline_parallel_size - rank - 1) * 2 + (vpp - 1) * group, total)
    order = forwards[:warmup]
    for i in range(total - warmup):
        order += [forwards[warmup + i], backwards[i]]
    order += backwards[total - warmup:]
    return order
