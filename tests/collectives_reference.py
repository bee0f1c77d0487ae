"""NumPy reference for reduce-scatter over a mesh-axis group (shared by both test levels)."""

import numpy as np

from core.parallel_state import ParallelState


def expected_reduce_scatter(state: ParallelState, per_rank: np.ndarray, axes: tuple[str, ...], dim: int) -> np.ndarray:
    """``per_rank[r]`` is rank r's input; returns each rank's expected output chunk."""
    out = [None] * len(per_rank)
    for group in state.groups(axes):
        total = sum(per_rank[r] for r in group)
        chunks = np.split(total, len(group), axis=dim)
        for i, r in enumerate(group):
            out[r] = chunks[i]
    return np.stack(out)


def expected_all_reduce(state: ParallelState, per_rank: np.ndarray, axes: tuple[str, ...], average: bool) -> np.ndarray:
    """``per_rank[r]`` is rank r's input; returns each rank's expected group sum (or mean)."""
    out = np.empty_like(per_rank)
    for group in state.groups(axes):
        total = sum(per_rank[r] for r in group)
        for r in group:
            out[r] = total / len(group) if average else total
    return out
