"""Global slot table of a pipeline schedule (pure Python), for the table-driven SPMD executor.

Every rank executes Megatron's order of steps (``schedule_table.get_pipeline_parallel_order``:
1F1B, or interleaved 1F1B with ``vpp`` model chunks) one step per time slot, as soon as the
step's input has arrived:

* chunk ``c`` of rank ``r`` is virtual stage ``c * pp + r`` (Megatron's interleaved layout);
* a forward needs the previous virtual stage's forward of the same microbatch done in an
  earlier slot (its activation is ``ppermute``\\ d at the end of that slot); virtual stage 0
  reads the microbatch itself;
* a backward needs its own forward done earlier and the next virtual stage's backward done
  earlier (its input-gradient arrives the same way); the last virtual stage needs only its own
  forward.

The result says, for every slot and rank, which (microbatch, chunk) runs forward and backward,
and how large the ring buffers must be: a (rank, chunk) keeps a microbatch's input activation
from its arrival to its backward (which recomputes the forward) and its output-gradient from
arrival to the backward; ``buffer_size`` is the smallest ring (indexed ``microbatch % size``) in
which no two live microbatches collide.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from core.pipeline_parallel.schedule_table import get_pipeline_parallel_order

IDLE = -1


@dataclasses.dataclass(frozen=True)
class Timeline:
    """What every rank does in every slot; entries are ``microbatch * vpp + chunk`` or -1."""

    forward: np.ndarray
    """[slots, pp] forward step per rank and slot (-1: none)."""
    backward: np.ndarray
    """[slots, pp] backward step per rank and slot (-1: none)."""
    num_model_chunks: int
    """vpp (1 without interleaving)."""
    buffer_size: int
    """Ring entries per chunk for stashed activations and received grads."""

    @property
    def num_slots(self) -> int:
        """Length of the slot loop."""
        return int(self.forward.shape[0])

    def bubble_fraction(self) -> float:
        """Idle share of the rank-slots (each busy slot holds one forward or one backward)."""
        busy = int((self.forward >= 0).sum() + (self.backward >= 0).sum())
        return 1.0 - busy / self.forward.size


def build_timeline(num_microbatches: int, pipeline_parallel_size: int, num_model_chunks: int = 1,
                   group_size: int | None = None, forward_only: bool = False) -> Timeline:
    """Place every rank's Megatron order into global slots (see module docstring)."""
    pp, vpp = pipeline_parallel_size, num_model_chunks
    orders = [get_pipeline_parallel_order(num_microbatches, pp, r, vpp if vpp > 1 else None, group_size,
                                          forward_only=forward_only) for r in range(pp)]
    last_vs = pp * vpp - 1
    pos = [0] * pp
    f_done: dict[tuple[int, int], int] = {}  # (virtual stage, mb) -> slot
    b_done: dict[tuple[int, int], int] = {}
    fwd_rows, bwd_rows = [], []
    t = 0
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        f_row, b_row = [IDLE] * pp, [IDLE] * pp
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            step = orders[r][pos[r]]
            vs, mb = step.chunk * pp + r, step.microbatch
            if step.kind == "F":
                ready = vs == 0 or f_done.get((vs - 1, mb), t) < t
            else:
                ready = f_done.get((vs, mb), t) < t and (vs == last_vs or b_done.get((vs + 1, mb), t) < t)
            if ready:
                (f_row if step.kind == "F" else b_row)[r] = mb * vpp + step.chunk
        for r in range(pp):
            for row, done in ((f_row, f_done), (b_row, b_done)):
                if row[r] >= 0:
                    mb, chunk = divmod(row[r], vpp)
                    done[(chunk * pp + r, mb)] = t
                    pos[r] += 1
        fwd_rows.append(f_row)
        bwd_rows.append(b_row)
        t += 1
        if t > 8 * (num_microbatches * vpp + pp * vpp) + 16:
            raise RuntimeError("pipeline schedule deadlocked: a step waits for an input that never arrives")
    size = _buffer_size(f_done, b_done, num_microbatches, pp * vpp)
    return Timeline(np.array(fwd_rows, np.int32), np.array(bwd_rows, np.int32), vpp, size)


def _buffer_size(f_done, b_done, num_microbatches: int, num_virtual: int) -> int:
    """Smallest ring size with no collision between live microbatches of any virtual stage."""
    live = {}
    for vs in range(num_virtual):
        for mb in range(num_microbatches):
            start = f_done[(vs - 1, mb)] + 1 if vs > 0 else f_done[(vs, mb)]
            live[(vs, mb)] = (start, b_done.get((vs, mb), f_done[(vs, mb)]))
    for size in range(1, num_microbatches + 1):
        clash = any(
            live[(vs, a)][0] <= live[(vs, b)][1] and live[(vs, b)][0] <= live[(vs, a)][1]
            for vs in range(num_virtual) for a in range(num_microbatches) for b in range(a + 1, num_microbatches)
            if a % size == b % size)
        if not clash:
            return size
    return num_microbatches
