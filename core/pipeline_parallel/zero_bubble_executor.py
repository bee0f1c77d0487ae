"""SPMD execution of the zero-bubble schedules: ZB-H1 (one model chunk per rank) and ZB-V (two, V-placed).

:func:`execute_stages_zb_h1` and :func:`execute_stages_zb_v` have
:func:`~core.pipeline_parallel.table_driven.execute_stages`' contract and return values; each runs
the slot table of :func:`~core.pipeline_parallel.zero_bubble.build_zb_h1_timeline` /
:func:`~core.pipeline_parallel.zero_bubble.build_zb_v_timeline` as one ``lax.scan`` (the shared
:func:`execute_zero_bubble`). Per slot a rank runs at most one step, each under ``lax.cond`` (an
idle rank computes nothing):

* **F**: the chunk's forward on the received activation (virtual stage 0: the microbatch);
  the stage metrics are recorded here, once per (microbatch, chunk).
* **B**: ``jax.vjp`` of the chunk with respect to (chunk params, shared params, input), recomputed
  from the stashed input as the 1F1B executor's backward is; only the input cotangent is taken
  (XLA drops the dead weight-gradient half) and sent to the previous virtual stage. The VJP's
  residuals (the leaves of the vjp function, a pytree) go to a ring buffer until W; residual
  leaves that *are* the chunk or shared params (the same tracer) are not buffered, W feeds the
  params again. The loss and token count are recorded here, on the last virtual stage, once per
  microbatch.
* **W**: the stored vjp function, rebuilt from the residual ring, applied to the stored output
  cotangent: the chunk and shared params' gradients, accumulated as the 1F1B executor does
  (honouring ``chunk_grad_combine``).

Communication (:class:`ZBPlan`, static tables from the slot table and the placement): each slot
ends with one ``ppermute`` to rank + 1 and one to rank - 1, each carrying the slot's outgoing
tensor (F's activation or B's input gradient) where its destination stage sits on that neighbour,
else zeros, and each skipped in the slots where no rank sends that way
(:func:`~core.pipeline_parallel.table_driven.skippable_ppermute`); a destination on the sending
rank itself (ZB-V's turn of the V on rank ``pp - 1``: chunk 0's output feeds its chunk 1, chunk
1's input gradient its chunk 0) is handed over locally.
Receivers read the sender's table entry to know which (microbatch, chunk) arrived. Compute per
microbatch and stage is F + (F + B) + W, the 1F1B executor's.

Buffers (per chunk, ring entries indexed ``microbatch % size``, sized from the table by
:func:`zb_buffer_sizes`): stage inputs from their arrival to B, residuals from B to W, output
cotangents from their arrival to W. :func:`live_activation_bound` counts the activations (an
input or a residual set) a rank holds at once. ZB-H1: ``pp`` on rank 0, 1F1B's count, and
``inputs + residuals <= 2 pp`` entries allocated. Residuals hold what the chunk's backward saves
(all activations of its layers, or what ``--recompute-activations``' policy keeps), which is
more than the 1F1B executor's stashed input per microbatch.

With ``w_recompute`` (:attr:`ZBPlan.w_recompute`, ``--zero-bubble-w-recompute``) nothing is
kept from B: W rebuilds the VJP by running the chunk's forward again from the stage input, which
then stays in its ring until W. A rank holds stage inputs and output cotangents only, about the
1F1B executor's memory, for one more chunk forward per microbatch (F + (F + B) + (F + W)).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from core.pipeline_parallel.table_driven import (
    accumulate_chunk_grads,
    execute_stages,
    skippable_ppermute,
    stage_runner,
)
from core.pipeline_parallel.zero_bubble import (
    ZeroBubbleTimeline,
    build_zb_h1_timeline,
    build_zb_v_timeline,
    place_orders,
    v_stage,
    zb_v_order,
)

FROM_PREV, FROM_NEXT, FROM_SELF = 0, 1, 2
"""Rows of :attr:`ZBPlan.arrivals`: what arrives from rank - 1, from rank + 1, from the rank itself."""


@dataclasses.dataclass(frozen=True)
class ZBBufferSizes:
    """Ring entries the zero-bubble executor allocates per kind and chunk (the same on every rank)."""

    inputs: int
    """Stage inputs, from their arrival to the microbatch's B."""
    residuals: int
    """The B step's VJP residuals, from B to W."""
    output_grads: int
    """Output cotangents, from their arrival to W."""


def h1_stages(pipeline_parallel_size: int) -> np.ndarray:
    """[pp, 1] virtual stage of each rank's chunk under ZB-H1 (stage ``r`` on rank ``r``)."""
    return np.arange(pipeline_parallel_size)[:, None]


def v_stages(pipeline_parallel_size: int) -> np.ndarray:
    """[pp, 2] virtual stage of each rank's chunks in the V placement
    (:func:`~core.pipeline_parallel.zero_bubble.v_stage`)."""
    pp = pipeline_parallel_size
    return np.array([[v_stage(pp, r, c) for c in range(2)] for r in range(pp)])


def _step_slots(timeline: ZeroBubbleTimeline, stages: np.ndarray) -> dict[tuple[str, int, int], int]:
    """(kind, virtual stage, microbatch) -> slot of every step in the table."""
    vpp = timeline.num_model_chunks
    out = {}
    for kind, table in (("F", timeline.forward), ("B", timeline.backward), ("W", timeline.weight)):
        for t, r in zip(*np.nonzero(table >= 0), strict=True):
            mb, c = divmod(int(table[t, r]), vpp)
            out[(kind, int(stages[r, c]), mb)] = int(t)
    return out


def _ring_size(spans: list[dict[int, tuple[int, int]]], m: int) -> int:
    """Smallest ring in which no two microbatches' (written at the end of slot, last read in slot)
    spans overlap in any buffer: a write at the end of the slot of the last read is fine."""
    for size in range(1, m + 1):
        if not any(sp[a][0] < sp[b][1] and sp[b][0] < sp[a][1]
                   for sp in spans for a in sp for b in sp if a < b and a % size == b % size):
            return size
    return max(m, 1)


def _num_microbatches(timeline: ZeroBubbleTimeline) -> int:
    return int(max(timeline.forward.max(), 0)) // timeline.num_model_chunks + 1


def _spans(timeline: ZeroBubbleTimeline, stages: np.ndarray, w_recompute: bool = False) -> tuple[list, list, list]:
    """Per virtual stage, microbatch -> (write slot, last read slot) of its input (stages > 0),
    residuals and output grad (stages < last). ``w_recompute``: W reads the input, no residuals."""
    done, m, last = _step_slots(timeline, stages), _num_microbatches(timeline), stages.size - 1
    # Forward only: an input is last read by its F.
    read = lambda s, i: done.get(("W" if w_recompute else "B", s, i), done["F", s, i])
    inputs = [{i: (done["F", s - 1, i], read(s, i)) for i in range(m)} for s in range(1, last + 1)]
    if not timeline.weight.max() >= 0:
        return inputs, [], []
    residuals = [] if w_recompute else [{i: (done["B", s, i], done["W", s, i]) for i in range(m)}
                                         for s in range(last + 1)]
    grads = [{i: (done["B", s + 1, i], done["W", s, i]) for i in range(m)} for s in range(last)]
    return inputs, residuals, grads


def zb_buffer_sizes(timeline: ZeroBubbleTimeline, stages: np.ndarray, w_recompute: bool = False) -> ZBBufferSizes:
    """The executor's ring sizes for ``timeline`` with ``stages[rank, chunk]`` its placement
    (``w_recompute``: inputs kept to W, no residual ring)."""
    m = _num_microbatches(timeline)
    inputs, residuals, grads = _spans(timeline, stages, w_recompute)
    return ZBBufferSizes(_ring_size(inputs, m), 0 if w_recompute else _ring_size(residuals, m), _ring_size(grads, m))


def zb_h1_buffer_sizes(timeline: ZeroBubbleTimeline, w_recompute: bool = False) -> ZBBufferSizes:
    """The ZB-H1 executor's ring sizes for ``timeline`` (see module docstring)."""
    return zb_buffer_sizes(timeline, h1_stages(timeline.forward.shape[1]), w_recompute)


def live_activation_bound(timeline: ZeroBubbleTimeline, stages: np.ndarray | None = None) -> np.ndarray:
    """[pp] most (microbatch, chunk) activations (stage input or B's residuals) a rank holds at the
    end of any slot: from the input's arrival (virtual stage 0: its F) to the W. ``stages``: the
    placement (default ZB-H1's)."""
    pp = timeline.forward.shape[1]
    stages = h1_stages(pp) if stages is None else stages
    done, m = _step_slots(timeline, stages), _num_microbatches(timeline)
    out = []
    for r in range(pp):
        spans = [(done["F", s - 1, i] if s > 0 else done["F", 0, i] - 1, done["W", s, i])
                 for s in stages[r] for i in range(m)]
        out.append(max(sum(a <= t < b for a, b in spans) for t in range(timeline.num_slots)))
    return np.array(out, np.int64)


@dataclasses.dataclass(frozen=True)
class ZBPlan:
    """Everything the executor reads from static tables: the slot table, the placement, buffer
    sizes and the routes of each slot's outgoing tensor."""

    timeline: ZeroBubbleTimeline
    """What every rank runs in every slot."""
    stages: np.ndarray
    """[pp, vpp] virtual stage of each rank's chunk."""
    sizes: ZBBufferSizes
    """Ring entries per kind and chunk."""
    to_next: np.ndarray
    """[slots, pp] whether the rank's outgoing tensor of the slot goes to rank + 1."""
    to_prev: np.ndarray
    """[slots, pp] whether it goes to rank - 1."""
    arrivals: np.ndarray
    """[3, slots, pp] what a rank receives at the end of a slot from rank - 1, rank + 1 and
    itself (:data:`FROM_PREV`, ...): ``(microbatch * vpp + chunk) * 2 + is_grad`` (the chunk and
    buffer it lands in), or -1."""
    w_recompute: bool = False
    """W recomputes the chunk's forward from the stage input (kept until W) instead of reading
    B's residuals: no residual ring, one more forward per microbatch and chunk."""


def build_plan(timeline: ZeroBubbleTimeline, stages: np.ndarray, w_recompute: bool = False) -> ZBPlan:
    """The :class:`ZBPlan` of ``timeline`` with ``stages[rank, chunk]`` its placement; adjacent
    virtual stages must sit on the same or neighbouring ranks. ``w_recompute``: see
    :attr:`ZBPlan.w_recompute`."""
    pp, vpp = stages.shape
    slots, last = timeline.num_slots, stages.size - 1
    where = {int(stages[r, c]): (r, c) for r in range(pp) for c in range(vpp)}
    to_next, to_prev = np.zeros((slots, pp), bool), np.zeros((slots, pp), bool)
    arrivals = np.full((3, slots, pp), -1, np.int32)
    for table, step, is_grad in ((timeline.forward, 1, 0), (timeline.backward, -1, 1)):
        for t, r in zip(*np.nonzero(table >= 0), strict=True):
            mb, c = divmod(int(table[t, r]), vpp)
            dest = int(stages[r, c]) + step
            if not 0 <= dest <= last:
                continue  # the last stage's output feeds its loss, stage 0's input gradient nothing
            r2, c2 = where[dest]
            if abs(r2 - r) > 1:
                raise ValueError(f"virtual stages {dest - step} and {dest} sit on ranks {r} and {r2}: not neighbours")
            to_next[t, r] |= r2 == r + 1
            to_prev[t, r] |= r2 == r - 1
            src = {r2 - 1: FROM_PREV, r2 + 1: FROM_NEXT, r2: FROM_SELF}[r]
            assert arrivals[src, t, r2] < 0, "two tensors arrive over one route in one slot"
            arrivals[src, t, r2] = (mb * vpp + c2) * 2 + is_grad
    return ZBPlan(timeline, stages, zb_buffer_sizes(timeline, stages, w_recompute), to_next, to_prev, arrivals,
                  w_recompute)


class _Residuals:
    """Splits a vjp function into buffered residual leaves and leaves that are the params.

    The split (tree structure and which leaves are params) is fixed at trace time and the same
    for every microbatch and chunk; :meth:`split` records it, :meth:`join` rebuilds the vjp function."""

    def __init__(self) -> None:
        self.tree: Any = None
        self.from_params: list[int | None] | None = None

    def split(self, vjp_fn: Callable, params: Any) -> list[jax.Array]:
        leaves, tree = jax.tree.flatten(vjp_fn)
        position = {id(w): j for j, w in enumerate(jax.tree.leaves(params))}
        from_params = [position.get(id(r)) for r in leaves]
        if self.from_params is not None and from_params != self.from_params:
            raise RuntimeError("the chunk's VJP residuals differ between traces of the same step")
        self.tree, self.from_params = tree, from_params
        return [r for r, j in zip(leaves, from_params, strict=True) if j is None]

    def join(self, kept: list[jax.Array], params: Any) -> Callable:
        whole, it = jax.tree.leaves(params), iter(kept)
        return jax.tree.unflatten(self.tree, [whole[j] if j is not None else next(it) for j in self.from_params])


def _put(buf: jax.Array, index: Any, value: jax.Array, ok: jax.Array) -> jax.Array:
    """``buf`` with entry ``index`` set to ``value`` where ``ok`` (an in-place update either way)."""
    return buf.at[index].set(jnp.where(ok, value.astype(buf.dtype), buf[index]))


def _zeros(s: jax.ShapeDtypeStruct) -> jax.Array:
    return jnp.zeros(s.shape, s.dtype)


def _store(acts: jax.Array, grads: jax.Array | None, code: jax.Array, value: jax.Array,
           sizes: ZBBufferSizes, vpp: int) -> tuple[jax.Array, jax.Array | None]:
    """The input and output-grad rings with one arrival (a :attr:`ZBPlan.arrivals` code) stored."""
    mbc, is_grad = jnp.divmod(jnp.maximum(code, 0), 2)
    mb, c = jnp.divmod(mbc, vpp)
    acts = _put(acts, (c, mb % sizes.inputs), value, (code >= 0) & (is_grad == 0))
    if grads is not None:
        grads = _put(grads, (c, mb % sizes.output_grads), value, (code >= 0) & (is_grad == 1))
    return acts, grads


def execute_zero_bubble(
    plan: ZBPlan,
    stage_step: Callable,
    data: Any,
    chunk_params: Any,
    shared_params: Any = None,
    *,
    forward_only: bool = False,
    axis_name: str = "pp",
    stage_metrics: bool = False,
    chunk_grad_combine: Any = None,
) -> tuple:
    """:func:`~core.pipeline_parallel.table_driven.execute_stages`' contract on ``plan``'s slot
    table and placement (module docstring); ``chunk_params``' leading dim is the placement's
    chunks. ``forward_only`` needs a table of F steps only (the loss is then recorded at F)."""
    timeline, sizes = plan.timeline, plan.sizes
    pp, vpp = plan.stages.shape
    m = jax.tree.leaves(data)[0].shape[0]
    rank, last = lax.axis_index(axis_name), pp * vpp - 1
    stages = jnp.asarray(plan.stages, jnp.int32)
    fwd_t, bwd_t, w_t = (jnp.asarray(a) for a in (timeline.forward, timeline.backward, timeline.weight))
    to_next, to_prev, arrivals = (jnp.asarray(a) for a in (plan.to_next, plan.to_prev, plan.arrivals))
    take = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    zeros_of = lambda tree: jax.tree.map(_zeros, tree)
    run, per_token = stage_runner(stage_step, m, stage_metrics)
    residuals = _Residuals()

    def unpack(code):
        mb, c = jnp.divmod(jnp.maximum(code, 0), vpp)
        return mb, c, stages[rank, c]

    def params(c):
        return take(chunk_params, c), shared_params

    def forward(args):
        acts, code = args
        mb, c, vs = unpack(code)
        y, (loss, nt, rd, sm) = run(*params(c), take(data, mb), acts[c, mb % sizes.inputs], vs)
        return y, (loss.astype(jnp.float32), nt, rd), sm

    def cotangents(out_grad, vs):
        # The last stage's output feeds only its own loss: seed the loss, not the output.
        is_last = vs == last
        return jnp.where(is_last, jnp.zeros_like(out_grad), out_grad), jnp.where(is_last, 1.0, 0.0).astype(jnp.float32)

    def chunk_vjp(acts, code):
        # The chunk's forward from its stashed input, differentiable in (chunk params, shared, input).
        mb, c, vs = unpack(code)

        def f(p, sp, r):
            out, (loss, nt, rd, _) = run(p, sp, take(data, mb), r, vs)
            return (out, loss.astype(jnp.float32)), (nt, rd)

        p_sp = params(c)
        return p_sp, jax.vjp(f, *p_sp, acts[c, mb % sizes.inputs], has_aux=True)

    def backward_input(args):
        acts, grads, code = args
        mb, c, vs = unpack(code)
        p_sp, ((_, loss), vjp_fn, (nt, rd)) = chunk_vjp(acts, code)
        gx = vjp_fn(cotangents(grads[c, mb % sizes.output_grads], vs))[2]
        return (loss, nt, rd), gx, ([] if plan.w_recompute else residuals.split(vjp_fn, p_sp))

    def backward_weight(args):
        acts, res, grads, code = args
        mb, c, vs = unpack(code)
        if plan.w_recompute:
            _, (_, vjp_fn, _) = chunk_vjp(acts, code)
        else:
            vjp_fn = residuals.join([r[c, mb % sizes.residuals] for r in res], params(c))
        gp, gs, _ = vjp_fn(cotangents(grads[c, mb % sizes.output_grads], vs))
        return gp, gs

    act_shape, (_, _, rd_shape, sm_shape) = jax.eval_shape(lambda: run(*params(0), take(data, 0), jnp.zeros(()), 0))
    act_zero = _zeros(act_shape)
    acts0 = jnp.zeros((vpp, sizes.inputs) + act_zero.shape, act_zero.dtype)
    no_loss = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros_of(rd_shape))
    no_f = (act_zero, no_loss, zeros_of(sm_shape))
    zero_shared = jax.tree.map(jnp.zeros_like, shared_params)
    if forward_only:
        grads0, res0, no_b = None, [], None
    else:
        grads0 = jnp.zeros((vpp, sizes.output_grads) + act_zero.shape, act_zero.dtype)
        b_shapes = jax.eval_shape(backward_input, (acts0, grads0, jnp.zeros((), jnp.int32)))
        no_b = zeros_of(b_shapes[:2])  # an idle B's loss record and input gradient
        res0 = [jnp.zeros((vpp, sizes.residuals) + s.shape, s.dtype) for s in b_shapes[2]]

    def b_step(args):
        acts, grads, res, code = args
        mb, c, _ = unpack(code)
        b_res, gx, kept = backward_input((acts, grads, code))
        return b_res, gx, [r.at[c, mb % sizes.residuals].set(v.astype(r.dtype)) for r, v in zip(res, kept, strict=True)]

    def b_idle(args):
        return (*no_b, args[2])

    def w_step(args):
        acts, res, grads, param_grads, shared_grads, code = args
        gp, gs = backward_weight((acts, res, grads, code))
        param_grads = accumulate_chunk_grads(param_grads, gp, unpack(code)[1], chunk_grad_combine)
        return param_grads, jax.tree.map(jnp.add, shared_grads, gs)

    def record(rds, ntok, code, result):
        mb, _, vs = unpack(code)
        hit = (code >= 0) & (vs == last)
        _, nt, rd = result
        rds = jax.tree.map(lambda acc, v: _put(acc, mb, v, hit), rds, rd)
        return rds, ntok + jnp.where(hit, nt, 0.0)

    def send(out, t, sends, pairs):
        return skippable_ppermute(jnp.where(sends[t, rank], out, 0), sends[t].any(), axis_name, pairs)

    def exchange(acts, grads, out, t):
        # At most one ppermute each way per slot; the turn of the V stays local.
        up = [(i, i + 1) for i in range(pp - 1)]
        received = [(FROM_SELF, out)]
        if plan.to_next.any():
            received.append((FROM_PREV, send(out, t, to_next, up)))
        if plan.to_prev.any():
            received.append((FROM_NEXT, send(out, t, to_prev, [(j, i) for i, j in up])))
        for src, value in received:
            if (plan.arrivals[src] >= 0).any():
                acts, grads = _store(acts, grads, arrivals[src, t, rank], value, sizes, vpp)
        return acts, grads

    def slot(carry, t):
        acts, grads, res, param_grads, shared_grads, rds, ntok, sms = carry
        f_code, b_code, w_code = fwd_t[t, rank], bwd_t[t, rank], w_t[t, rank]
        y, f_res, sm = lax.cond(f_code >= 0, forward, lambda _: no_f, (acts, f_code))
        sms = jax.tree.map(lambda acc, v: acc.at[unpack(f_code)[0]].add(v), sms, sm)  # idle: adds zeros
        if forward_only:
            rds, ntok = record(rds, ntok, f_code, f_res)
            out = y
        else:
            # The buffers and accumulators go through the conds: an idle branch returns them as they
            # are (no zero-filled residuals or gradients to write or add in the slots without B or W).
            b_res, gx, res = lax.cond(b_code >= 0, b_step, b_idle, (acts, grads, res, b_code))
            rds, ntok = record(rds, ntok, b_code, b_res)
            param_grads, shared_grads = lax.cond(w_code >= 0, w_step, lambda a: a[3:5],
                                                 (acts, res, grads, param_grads, shared_grads, w_code))
            out = jnp.where(f_code >= 0, y, gx)  # a rank runs one step per slot: at most one is sent
        acts, grads = exchange(acts, grads, out, t)
        return (acts, grads, res, param_grads, shared_grads, rds, ntok, sms), None

    per_mb = lambda tree: jax.tree.map(lambda z: jnp.zeros((m,) + z.shape, z.dtype), tree)
    init = (acts0, grads0, res0, jax.tree.map(jnp.zeros_like, chunk_params), zero_shared,
            per_mb(zeros_of(rd_shape)), jnp.zeros((), jnp.float32), per_mb(zeros_of(sm_shape)))
    (_, _, _, param_grads, shared_grads, rds, ntok, sms), _ = lax.scan(slot, init, jnp.arange(timeline.num_slots))
    if forward_only:
        param_grads = shared_grads = None
    out = ([take(rds, i) for i in range(m)], param_grads, shared_grads, (ntok if per_token["yes"] else None))
    if stage_metrics:
        sms = jax.tree.map(lambda a: lax.psum(a, axis_name), sms)
        out += ([take(sms, i) for i in range(m)],)
    return out


def execute_stages_zb_h1(
    stage_step: Callable,
    data: Any,
    chunk_params: Any,
    shared_params: Any = None,
    *,
    num_model_chunks: int = 1,
    forward_only: bool = False,
    microbatch_group_size_per_vp_stage: int | None = None,
    axis_name: str = "pp",
    stage_metrics: bool = False,
    chunk_grad_combine: Any = None,
    w_recompute: bool = False,
) -> tuple:
    """ZB-H1 with :func:`~core.pipeline_parallel.table_driven.execute_stages`' contract (module docstring).

    ``num_model_chunks`` must be 1 and the microbatch count at least the pipeline size. Forward
    only has no backward to split: it runs the 1F1B executor's forward-only table.
    ``w_recompute``: W recomputes the forward from the stage input (:attr:`ZBPlan.w_recompute`).
    """
    if num_model_chunks != 1:
        raise ValueError(f"ZB-H1 runs one model chunk per pipeline rank, got num_model_chunks {num_model_chunks}")
    if forward_only:
        return execute_stages(stage_step, data, chunk_params, shared_params, forward_only=True, axis_name=axis_name,
                              stage_metrics=stage_metrics, chunk_grad_combine=chunk_grad_combine)
    del microbatch_group_size_per_vp_stage  # one chunk: nothing to group
    pp, m = lax.axis_size(axis_name), jax.tree.leaves(data)[0].shape[0]
    plan = build_plan(build_zb_h1_timeline(m, pp), h1_stages(pp), w_recompute)
    return execute_zero_bubble(plan, stage_step, data, chunk_params, shared_params, axis_name=axis_name,
                               stage_metrics=stage_metrics, chunk_grad_combine=chunk_grad_combine)


def zb_v_forward_timeline(num_microbatches: int, pipeline_parallel_size: int) -> ZeroBubbleTimeline:
    """ZB-V's F steps alone (forward only, e.g. evaluation), each as soon as its input arrived
    (:func:`~core.pipeline_parallel.zero_bubble.place_orders`)."""
    pp = pipeline_parallel_size
    build_zb_v_timeline(num_microbatches, pp)  # the same checks
    orders = [[s for s in zb_v_order(num_microbatches, pp, r) if s.kind == "F"] for r in range(pp)]
    return place_orders(orders, 2, lambda r, c: v_stage(pp, r, c))


def execute_stages_zb_v(
    stage_step: Callable,
    data: Any,
    chunk_params: Any,
    shared_params: Any = None,
    *,
    num_model_chunks: int = 2,
    forward_only: bool = False,
    microbatch_group_size_per_vp_stage: int | None = None,
    axis_name: str = "pp",
    stage_metrics: bool = False,
    chunk_grad_combine: Any = None,
    w_recompute: bool = False,
) -> tuple:
    """ZB-V with :func:`~core.pipeline_parallel.table_driven.execute_stages`' contract (module
    docstring), except the placement: chunk 0 of rank ``r`` is virtual stage ``r``, chunk 1 is
    ``2 pp - 1 - r`` (:func:`v_stages`). ``num_model_chunks`` must be 2 and the microbatch count
    at least the pipeline size; forward only runs ZB-V's F steps alone. ``w_recompute``: W
    recomputes the forward from the stage input (:attr:`ZBPlan.w_recompute`)."""
    if num_model_chunks != 2:
        raise ValueError(f"ZB-V runs two model chunks per pipeline rank, got num_model_chunks {num_model_chunks}")
    del microbatch_group_size_per_vp_stage  # the V order fixes the chunks' interleaving
    pp, m = lax.axis_size(axis_name), jax.tree.leaves(data)[0].shape[0]
    timeline = zb_v_forward_timeline(m, pp) if forward_only else build_zb_v_timeline(m, pp)
    plan = build_plan(timeline, v_stages(pp), w_recompute)
    return execute_zero_bubble(plan, stage_step, data, chunk_params, shared_params,
                               forward_only=forward_only, axis_name=axis_name, stage_metrics=stage_metrics,
                               chunk_grad_combine=chunk_grad_combine)


def _megatron_stage_step(forward_step_func: Callable, stage_fn: Callable) -> Callable:
    """Megatron's ``forward_step_func`` / ``stage_fn`` as an executor ``stage_step``."""

    def stage_step(p, _shared, d, received, vs):
        out, loss_func = forward_step_func(d, lambda x: stage_fn(p, jnp.where(vs == 0, x, received)))
        return out, loss_func(out)

    return stage_step


def execute_schedule_zb_h1(
    forward_step_func: Callable,
    data: Any,
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    *,
    forward_only: bool = False,
    axis_name: str = "pp",
    w_recompute: bool = False,
) -> tuple[list[dict], Any, jax.Array | None]:
    """ZB-H1 on Megatron's contract (as :func:`~core.pipeline_parallel.table_driven.execute_schedule`,
    ``params`` with a leading ``[1]`` chunk dim); returns ``(losses_reduced, grads, num_tokens)``."""
    losses, grads, _, ntok = execute_stages_zb_h1(_megatron_stage_step(forward_step_func, stage_fn), data, params,
                                                  None, forward_only=forward_only, axis_name=axis_name,
                                                  w_recompute=w_recompute)
    return losses, grads, ntok


def execute_schedule_zb_v(
    forward_step_func: Callable,
    data: Any,
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    *,
    forward_only: bool = False,
    axis_name: str = "pp",
    w_recompute: bool = False,
) -> tuple[list[dict], Any, jax.Array | None]:
    """ZB-V on Megatron's contract, ``params`` with a leading ``[2]`` chunk dim in the V placement
    (chunk 1 of rank ``r`` is virtual stage ``2 pp - 1 - r``); returns ``(losses_reduced, grads, num_tokens)``."""
    losses, grads, _, ntok = execute_stages_zb_v(_megatron_stage_step(forward_step_func, stage_fn), data, params,
                                                 None, forward_only=forward_only, axis_name=axis_name,
                                                 w_recompute=w_recompute)
    return losses, grads, ntok
