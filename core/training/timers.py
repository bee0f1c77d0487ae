"""Per-rank timers of the training loop's host-side phases (Megatron's ``--timing-log-level`` and
``--timing-log-option``).

Each process times what its host does in every iteration with ``time.perf_counter``: building the
batch (``batch-generator``), dispatching the jitted step (``step-dispatch``), waiting for the
device (``device-wait``: blocked on a step's result, the only place the loop syncs), evaluating
(``evaluate``) and checkpointing (``save-checkpoint``). Nothing here touches the device, so the
timers add no sync to the loop. At each log line every process contributes its totals since the
previous one (one small ``allgather`` over MPI, the only collective of the timers), divided by the
iterations they cover, and rank 0 prints them as Megatron's ``Timers.log`` does, naming the
slowest rank of every phase: a slow data source or a slow host shows up by rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import numpy as np

TIMER_LEVELS = {"batch-generator": 1, "step-dispatch": 1, "device-wait": 1, "evaluate": 1, "save-checkpoint": 1}
"""Each phase's timing level: ``--timing-log-level`` N logs the phases of level <= N (Megatron's
level 0 logs only the iteration time, which the log line always has)."""

TIMING_LOG_OPTIONS = ("max", "minmax", "all")
"""``--timing-log-option`` choices: the max over ranks, min and max, or every rank's value."""


def allgather_rows(row: np.ndarray) -> np.ndarray:
    """Every process's ``row`` stacked as ``[processes, len(row)]`` (mpi4py's allgather under an MPI
    launcher, the row alone in a single process)."""
    import jax

    if jax.process_count() == 1:
        return row[None, :]
    from mpi4py import MPI

    return np.stack(MPI.COMM_WORLD.allgather(row))


class Timers:
    """Host-side phase times of one process, summed until :meth:`gather` reads them."""

    def __init__(self, log_level: int = 0, log_option: str = "minmax"):
        if log_option not in TIMING_LOG_OPTIONS:
            raise ValueError(f"timing log option must be one of {', '.join(TIMING_LOG_OPTIONS)}, got {log_option!r}")
        self.log_level = log_level
        """``--timing-log-level``: phases of a higher level are not timed (0: none)."""
        self.log_option = log_option
        """``--timing-log-option``: ``max``, ``minmax`` or ``all``."""
        self.names = [name for name, level in TIMER_LEVELS.items() if level <= log_level]
        """The phases timed, in the order they are logged."""
        self._elapsed = dict.fromkeys(self.names, 0.0)

    @property
    def enabled(self) -> bool:
        """Whether any phase is timed (and :meth:`gather` must run on every process)."""
        return bool(self.names)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Add the time the ``with`` block takes to phase ``name`` (a no-op for a phase not timed)."""
        if name not in self._elapsed:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._elapsed[name] += time.perf_counter() - start

    def gather(self, iterations: int) -> TimerReport | None:
        """Every process's seconds per iteration of each phase over the last ``iterations``
        iterations (collective: every process calls it at the same iteration); resets the sums.
        None when no phase is timed."""
        if not self.enabled:
            return None
        row = np.array([self._elapsed[n] for n in self.names], np.float64) / max(1, iterations)
        self._elapsed = dict.fromkeys(self.names, 0.0)
        return TimerReport(self.names, allgather_rows(row), self.log_option)


class TimerReport:
    """Seconds per iteration of each phase on each rank, as gathered at one log line."""

    def __init__(self, names: Sequence[str], seconds: np.ndarray, log_option: str = "minmax"):
        self.names = list(names)
        """The phases, in order."""
        self.seconds = np.asarray(seconds, np.float64)
        """``[ranks, phases]`` seconds per iteration."""
        self.log_option = log_option
        """How :meth:`describe` reports the ranks (``--timing-log-option``)."""

    def max_seconds(self) -> dict[str, float]:
        """Each phase's max over ranks (what Megatron writes to TensorBoard as ``<name>-time``),
        the phases some rank spent time in."""
        return {n: float(self.seconds[:, i].max()) for i, n in enumerate(self.names) if self.seconds[:, i].max() > 0}

    def slowest_rank(self, name: str) -> int:
        """The rank that spent the most time in phase ``name``."""
        return int(np.argmax(self.seconds[:, self.names.index(name)]))

    def describe(self) -> str:
        """Megatron's ``Timers.log`` lines (milliseconds per iteration) with the slowest rank of each
        phase; empty when no rank spent time in any phase."""
        ms = 1000.0 * self.seconds
        # As Megatron: a phase no rank spent time in (no evaluation or save in the interval) is left
        # out, and min is over the ranks that spent time in it.
        timed = [(i, name) for i, name in enumerate(self.names) if (ms[:, i] > 0).any()]
        if not timed:
            return ""
        if self.log_option == "all":
            lines = ["times across ranks (ms):"]
            for i, name in timed:
                lines.append(f"  {name}: (slowest: rank {self.slowest_rank(name)})")
                lines += [f"     rank {rank:2d}: {ms[rank, i]:.2f}" for rank in range(ms.shape[0])]
            return "\n".join(lines)
        max_only = self.log_option == "max"
        lines = ["max time across ranks (ms):" if max_only else "(min, max) time across ranks (ms):"]
        for i, name in timed:
            low = ms[ms[:, i] > 0, i].min()
            values = f"{ms[:, i].max():.2f}" if max_only else f"({low:.2f}, {ms[:, i].max():.2f})"
            lines.append(f"    {(name + ' ').ljust(48, '.')}: {values} slowest: rank {self.slowest_rank(name)}")
        return "\n".join(lines)
