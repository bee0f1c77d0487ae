"""Shared by the benchmarks: median wall time of a jitted call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
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
