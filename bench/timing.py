"""Shared by the benchmarks: median wall time of jitted calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def median_seconds(fn: Callable[..., Any], *args: Any, reps: int = 5, warmup: int = 1) -> float:
    """Median of ``reps`` timed calls of ``fn(*args)`` after ``warmup`` untimed ones (compile)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def round_robin_medians(fns: Sequence[Callable[[], Any]], reps: int = 5, warmup: int = 1) -> list[float]:
    """Median seconds of each ``fn()`` over ``reps`` rounds that call every function once in turn
    (so the host's slow spells hit all of them alike), after ``warmup`` untimed rounds."""
    import jax

    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + reps):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            if i >= warmup:
                ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]
