"""Shared by the benchmarks: median wall time of jitted calls, and a run's clock and load record."""

from __future__ import annotations

import os
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


def round_robin_times(fns: Sequence[Callable[[], Any]], reps: int = 5, warmup: int = 1,
                      clocks: Sequence[Callable[[], float]] = (time.perf_counter,)) -> list[list[list[float]]]:
    """``times[f][c][i]``: seconds of ``fns[f]()`` on ``clocks[c]`` in round ``i``. Each of ``reps``
    rounds calls every function once in turn, so the host's slow spells hit all of them alike
    (and same-round differences cancel them), after ``warmup`` untimed rounds; round ``i``
    starts at function ``i mod n``, so no function always runs after the same one (whose freed
    buffers and caches it meets). Wall time by default; ``time.process_time`` counts this
    process's CPU time, which other jobs on the host inflate less."""
    import jax

    times: list[list[list[float]]] = [[[] for _ in clocks] for _ in fns]
    for i in range(warmup + reps):
        for j in range(len(fns)):
            f = (i + j) % len(fns)
            start = [clock() for clock in clocks]
            jax.block_until_ready(fns[f]())
            if i >= warmup:
                for clock, t0, ts in zip(clocks, start, times[f]):
                    ts.append(clock() - t0)
    return times


def round_robin_medians(fns: Sequence[Callable[[], Any]], reps: int = 5, warmup: int = 1,
                        clocks: Sequence[Callable[[], float]] = (time.perf_counter,)) -> list[tuple[float, ...]]:
    """Per function, the median seconds on each clock of :func:`round_robin_times`."""
    times = round_robin_times(fns, reps, warmup, clocks)
    return [tuple(statistics.median(ts) for ts in per_clock) for per_clock in times]


class BenchRun:
    """One benchmark run's clock and host load, for its progress lines and its report's header
    (these machines are shared: a figure is read with the load it was measured under)."""

    def __init__(self) -> None:
        self.load_start = os.getloadavg()[0]
        """1-min load average when the run started."""
        self.started = time.perf_counter()
        """``time.perf_counter()`` at the start."""
        self._marks = [(self.started, time.process_time())]

    def lap(self) -> str:
        """Wall and CPU seconds since the previous lap (or the start), e.g. ``"41 s, 77 s CPU"``."""
        self._marks.append((time.perf_counter(), time.process_time()))
        (wall0, cpu0), (wall1, cpu1) = self._marks[-2:]
        return f"{wall1 - wall0:.0f} s, {cpu1 - cpu0:.0f} s CPU"

    def elapsed(self) -> float:
        """Wall seconds since the start."""
        return time.perf_counter() - self.started

    def header(self, command: str, machine: str, note: str = "") -> str:
        """The report's first line: the command, the date, the machine, the run's length and the
        load average at its start and now, then ``note``."""
        return (f"`{command}`, {time.strftime('%Y-%m-%d')}, {machine}; {self.elapsed():.0f} s; 1-min load average "
                f"{self.load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
                + (f". {note}" if note else ""))
