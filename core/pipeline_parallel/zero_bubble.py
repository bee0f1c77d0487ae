"""Global slot tables of zero-bubble pipeline schedules (pure Python/numpy): ZB-H1 and ZB-V.

Zero-bubble pipelining (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) splits a
stage's backward into **B** (the input gradient, which the upstream stage waits for) and **W**
(the weight gradient, which only the optimizer step needs), so W steps can fill the bubbles.

Every rank runs one step (F, B or W, each one unit of time) per global slot, in its own fixed
order, as soon as the step's inputs have arrived (the same in-order model as ``timeline.py``):

* F of virtual stage ``s`` needs F of ``s - 1`` (same microbatch) done in an earlier slot;
  virtual stage 0 reads the microbatch itself;
* B of ``s`` needs its own F and B of ``s + 1`` done earlier; the last virtual stage needs only
  its own F;
* W of ``s`` needs its own B done earlier (same rank).

Orders:

* **ZB-H1** (one stage per rank): 1F1B's ``pp - 1 - r`` warm-up forwards, then F/B pairs; from
  the ``(r + 1)``-th B on, each B is followed by the W of the oldest microbatch whose B is done,
  so W lags B by ``r`` microbatches; the ``r`` outstanding W's fill the cool-down bubble.
* **ZB-V** (two chunks per rank, V placement: chunk 0 of rank ``r`` is virtual stage ``r``,
  chunk 1 is ``2 pp - 1 - r``, so the loss stage sits on rank 0): the paper's handcrafted order
  for equal F/B/W times (as in PyTorch's ``ScheduleZBVZeroBubble``), generated for
  ``n = max(m, 2 pp - 1)`` microbatches with the steps of microbatches ``>= m`` dropped.

Activation accounting: a (microbatch, chunk) is *live* on its rank from its F to its W. The
paper keeps the stage input (and the output gradient) until W because W needs them to form
``dW = X^T dY``; only part of the activation could be dropped at B, so counting to W is the
conservative bound the memory targets are stated against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from core.pipeline_parallel.schedule_table import get_pipeline_parallel_order

IDLE = -1

Kind = Literal["F", "B", "W"]


@dataclasses.dataclass(frozen=True)
class ZBStep:
    """One unit of work of a pipeline rank under a B/W-split schedule."""

    kind: Kind
    """Forward, input-gradient backward, or weight-gradient backward."""
    microbatch: int
    """Microbatch index in ``[0, m)``."""
    chunk: int = 0
    """Model chunk on this rank, ``[0, vpp)``."""


@dataclasses.dataclass(frozen=True)
class ZeroBubbleTimeline:
    """What every rank does in every slot; entries are ``microbatch * vpp + chunk`` or -1."""

    forward: np.ndarray
    """[slots, pp] forward step per rank and slot (-1: none)."""
    backward: np.ndarray
    """[slots, pp] input-gradient (B) step per rank and slot (-1: none)."""
    weight: np.ndarray
    """[slots, pp] weight-gradient (W) step per rank and slot (-1: none)."""
    num_model_chunks: int
    """vpp: 1 for ZB-H1, 2 for ZB-V."""
    orders: tuple[tuple[ZBStep, ...], ...]
    """Per rank, the order in which its steps run (what the table places into slots)."""

    @property
    def num_slots(self) -> int:
        """Length of the slot loop."""
        return int(self.forward.shape[0])

    def idle_slots(self) -> np.ndarray:
        """[pp] idle slots per rank over the whole table."""
        busy = (self.forward >= 0) | (self.backward >= 0) | (self.weight >= 0)
        return (~busy).sum(axis=0)

    def bubble_fraction(self) -> float:
        """Idle share of the rank-slots (each F, B and W takes one slot)."""
        return float(self.idle_slots().sum()) / self.forward.size

    def bubble_time_fraction(self) -> float:
        """Megatron's bubble time fraction ``t_pb / t_id``: idle over busy rank-slots (1F1B's
        ``(p-1)/m`` in any unit). With equal F, B and W times no schedule idles less than
        ``pp - 1`` units per rank (the last stage's rank waits that long for its first input and
        every rank has the same work); ZB-H1 (m >= pp) and ZB-V (m >= 2pp - 1) idle exactly that."""
        idle = float(self.idle_slots().sum())
        return idle / (self.forward.size - idle)

    def peak_live_activations(self) -> np.ndarray:
        """[pp] most (microbatch, chunk) activations a rank holds at once, each live from its F to its W."""
        return np.array([peak_live(order) for order in self.orders], np.int64)


def peak_live(order: Sequence[ZBStep], release: Kind = "W") -> int:
    """Most activations live at once along one rank's order; each is released by its ``release`` step."""
    live = peak = 0
    for step in order:
        if step.kind == "F":
            live += 1
            peak = max(peak, live)
        elif step.kind == release:
            live -= 1
    return peak


def zb_h1_order(num_microbatches: int, pipeline_parallel_size: int, rank: int,
                w_lag: int | None = None) -> list[ZBStep]:
    """ZB-H1 order of one rank; ``w_lag`` (default ``rank``) is how many microbatches W trails B.

    ``w_lag=0`` gives 1F1B with its backward split into B then W back to back.
    """
    m, pp, r = num_microbatches, pipeline_parallel_size, rank
    lag = r if w_lag is None else w_lag
    warmup = min(pp - 1 - r, m)
    order = [ZBStep("F", i) for i in range(warmup)]
    next_w = 0

    def after_b(b_index: int) -> None:
        # The W of the oldest B-done microbatch runs once W trails B by `lag` microbatches.
        nonlocal next_w
        if b_index >= lag:
            order.append(ZBStep("W", next_w))
            next_w += 1

    for i in range(m - warmup):
        order.append(ZBStep("F", warmup + i))
        order.append(ZBStep("B", i))
        after_b(i)
    for i in range(m - warmup, m):
        order.append(ZBStep("B", i))
        after_b(i)
    order.extend(ZBStep("W", i) for i in range(next_w, m))
    return order


def zb_v_order(num_microbatches: int, pipeline_parallel_size: int, rank: int) -> list[ZBStep]:
    """ZB-V order of one rank (the paper's handcrafted schedule for equal F/B/W times)."""
    m, pp, r = num_microbatches, pipeline_parallel_size, rank
    # The handcrafted order needs at least 2pp-1 microbatches to be deadlock-free; extra ones are dropped.
    n = max(m, 2 * pp - 1)
    order: list[ZBStep] = []
    count = {(k, c): 0 for k in "FBW" for c in (0, 1)}

    def add(kind: Kind, chunk: int) -> None:
        mb = count[(kind, chunk)]
        count[(kind, chunk)] += 1
        if mb < m:
            order.append(ZBStep(kind, mb, chunk))

    for _ in range(2 * (pp - r) - 1):
        add("F", 0)
    for _ in range(r):
        add("F", 1)
        add("F", 0)
    for _ in range(pp - r):
        add("F", 1)
        add("B", 1)
        add("W", 1)
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:
        if count[("F", 0)] < n:
            add("F", 0)
        add("B", 0)
        add("W", 0)
        add("F", 1)
        add("B", 1)
        add("W", 1)
    for _ in range(r):
        add("B", 0)
        add("B", 1)
    for _ in range(pp - r):
        add("B", 0)
        add("W", 0)
    while count[("W", 1)] < n:
        add("W", 1)
    while count[("W", 0)] < n:
        add("W", 0)
    return order


def v_stage(pipeline_parallel_size: int, rank: int, chunk: int) -> int:
    """Virtual stage of a rank's chunk in the V placement (chunk 1 of rank 0 is the last stage)."""
    return rank if chunk == 0 else 2 * pipeline_parallel_size - 1 - rank


def place_orders(orders: Sequence[Sequence[ZBStep]], num_model_chunks: int, stage_of: Callable[[int, int], int],
                 fused_backward: bool = False) -> ZeroBubbleTimeline:
    """Run every rank's order one step per slot, each step as soon as its inputs arrived (module docstring).

    ``fused_backward`` makes B of a stage wait for the next stage's W too: the next stage's
    backward is then one B+W step, as in 1F1B, instead of handing its input gradient on after B.
    """
    pp, vpp = len(orders), num_model_chunks
    last_vs = pp * vpp - 1
    pos = [0] * pp
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, virtual stage, microbatch) -> slot
    rows: dict[Kind, list[list[int]]] = {"F": [], "B": [], "W": []}
    limit = 4 * sum(len(o) for o in orders) + 16
    t = 0
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        row = {k: [IDLE] * pp for k in "FBW"}
        ran = []
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            step = orders[r][pos[r]]
            vs, mb = stage_of(r, step.chunk), step.microbatch

            def before(kind: Kind, stage: int, mb: int = mb, t: int = t) -> bool:
                return done.get((kind, stage, mb), t) < t

            if step.kind == "F":
                ready = vs == 0 or before("F", vs - 1)
            elif step.kind == "B":
                ready = before("F", vs) and (vs == last_vs or before("W" if fused_backward else "B", vs + 1))
            else:
                ready = before("B", vs)
            if ready:
                row[step.kind][r] = mb * vpp + step.chunk
                ran.append((step.kind, vs, mb, r))
        for kind, vs, mb, r in ran:
            done[(kind, vs, mb)] = t
            pos[r] += 1
        for k in "FBW":
            rows[k].append(row[k])
        t += 1
        if t > limit:
            raise RuntimeError("pipeline schedule deadlocked: a step waits for an input that never arrives")
    return ZeroBubbleTimeline(np.array(rows["F"], np.int32).reshape(-1, pp),
                              np.array(rows["B"], np.int32).reshape(-1, pp),
                              np.array(rows["W"], np.int32).reshape(-1, pp), vpp,
                              tuple(tuple(o) for o in orders))


def _check(num_microbatches: int, pipeline_parallel_size: int) -> None:
    if pipeline_parallel_size < 1 or num_microbatches < pipeline_parallel_size:
        raise ValueError(f"zero-bubble schedules need pp >= 1 and num_microbatches >= pp, got pp "
                         f"{pipeline_parallel_size}, num_microbatches {num_microbatches}")


def build_zb_h1_timeline(num_microbatches: int, pipeline_parallel_size: int) -> ZeroBubbleTimeline:
    """Global slot table of ZB-H1 (one stage per rank; stage ``r`` on rank ``r``)."""
    _check(num_microbatches, pipeline_parallel_size)
    orders = [zb_h1_order(num_microbatches, pipeline_parallel_size, r) for r in range(pipeline_parallel_size)]
    return place_orders(orders, 1, lambda r, c: r)


def build_split_1f1b_timeline(num_microbatches: int, pipeline_parallel_size: int) -> ZeroBubbleTimeline:
    """1F1B in the same units: each backward is a B immediately followed by its W."""
    _check(num_microbatches, pipeline_parallel_size)
    orders = [zb_h1_order(num_microbatches, pipeline_parallel_size, r, w_lag=0)
              for r in range(pipeline_parallel_size)]
    return place_orders(orders, 1, lambda r, c: r, fused_backward=True)


def build_zb_v_timeline(num_microbatches: int, pipeline_parallel_size: int) -> ZeroBubbleTimeline:
    """Global slot table of ZB-V (two chunks per rank in the V placement, see :func:`v_stage`)."""
    _check(num_microbatches, pipeline_parallel_size)
    pp = pipeline_parallel_size
    orders = [zb_v_order(num_microbatches, pp, r) for r in range(pp)]
    return place_orders(orders, 2, lambda r, c: v_stage(pp, r, c))


def one_f_one_b_reference(num_microbatches: int, pipeline_parallel_size: int) -> tuple[float, int]:
    """1F1B's bubble fraction and peak live activations per rank with F, B and W one unit each.

    The bubble is the paper's ``(pp - 1)(T_F + T_B + T_W)`` over the step time
    ``m (T_F + T_B + T_W) + (pp - 1)(T_F + T_B + T_W)``; the peak is ``pp`` (rank 0 holds its
    ``pp - 1`` warm-up forwards plus the one in steady state).
    """
    m, pp = num_microbatches, pipeline_parallel_size
    return 3 * (pp - 1) / (3 * m + 3 * (pp - 1)), min(pp, m)


def interleaved_1f1b_peak_live(num_microbatches: int, pipeline_parallel_size: int,
                               num_model_chunks: int = 2) -> np.ndarray:
    """[pp] peak live chunk activations per rank of Megatron's interleaved 1F1B (live from F to its backward).

    Interleaved 1F1B runs W right after B, so its backward releases the activation; this is the
    bound ZB-V's chunk activations are compared against.
    """
    orders = [get_pipeline_parallel_order(num_microbatches, pipeline_parallel_size, r, num_model_chunks)
              for r in range(pipeline_parallel_size)]
    return np.array([peak_live([ZBStep(s.kind, s.microbatch, s.chunk) for s in o], release="B") for o in orders],
                    np.int64)
