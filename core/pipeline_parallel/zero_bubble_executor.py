"""SPMD execution of the ZB-H1 zero-bubble schedule (one model chunk per rank).

:func:`execute_stages_zb_h1` has :func:`~core.pipeline_parallel.table_driven.execute_stages`'
contract and return values; it runs the slot table of
:func:`~core.pipeline_parallel.zero_bubble.build_zb_h1_timeline` as one ``lax.scan``. Per slot
a rank runs at most one step, each under ``lax.cond`` (an idle rank computes nothing):

* **F**: the chunk's forward on the received activation (virtual stage 0: the microbatch);
  the stage metrics are recorded here, once per microbatch.
* **B**: ``jax.vjp`` of the chunk with respect to (chunk params, shared params, input), recomputed
  from the stashed input as the 1F1B executor's backward is; only the input cotangent is taken
  (XLA drops the dead weight-gradient half) and sent upstream. The VJP's residuals (the leaves of
  the vjp function, a pytree) go to a ring buffer until W; residual leaves that *are* the chunk or
  shared params (the same tracer) are not buffered, W feeds the params again. The loss and token
  count are recorded here, on the last stage, once per microbatch.
* **W**: the stored vjp function, rebuilt from the residual ring, applied to the stored output
  cotangent: the chunk and shared params' gradients, accumulated as the 1F1B executor does
  (honouring ``chunk_grad_combine``).

Each slot ends with the same two ring ``ppermute``\\ s as the 1F1B executor (F's activation down,
B's input gradient up). Compute per microbatch and stage is F + (F + B) + W, the 1F1B executor's.

Buffers (ring entries indexed ``microbatch % size``, sized from the table by
:func:`zb_h1_buffer_sizes`): stage inputs from their arrival to B, residuals from B to W, output
cotangents from their arrival to W. A rank holds at most :func:`live_activation_bound`
microbatches' activations (an input or a residual set) at once, the table's ``peak_live`` (``pp``
on rank 0, 1F1B's count); the SPMD arrays are sized for the busiest rank of each kind, so
``inputs + residuals <= 2 pp`` entries are allocated. Residuals hold what the chunk's backward
saves (all activations of its layers, or what ``--recompute-activations``' policy keeps), which
is more than the 1F1B executor's stashed input per microbatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from core.pipeline_parallel.table_driven import accumulate_chunk_grads, execute_stages, stage_runner
from core.pipeline_parallel.zero_bubble import ZeroBubbleTimeline, build_zb_h1_timeline


@dataclasses.dataclass(frozen=True)
class ZBBufferSizes:
    """Ring entries the ZB-H1 executor allocates per kind (the same on every rank)."""

    inputs: int
    """Stage inputs, from their arrival to the microbatch's B."""
    residuals: int
    """The B step's VJP residuals, from B to W."""
    output_grads: int
    """Output cotangents, from their arrival to W."""


def _slots(table: np.ndarray, rank: int) -> dict[int, int]:
    """Microbatch -> slot of ``rank``'s steps in one table (vpp 1: entries are microbatches)."""
    return {int(table[t, rank]): t for t in range(table.shape[0]) if table[t, rank] >= 0}


def _ring_size(spans: list[dict[int, tuple[int, int]]], m: int) -> int:
    """Smallest ring in which no two microbatches' (written at the end of slot, last read in slot)
    spans overlap on any rank: a write at the end of the slot of the last read is fine."""
    for size in range(1, m + 1):
        if not any(sp[a][0] < sp[b][1] and sp[b][0] < sp[a][1]
                   for sp in spans for a in sp for b in sp if a < b and a % size == b % size):
            return size
    return max(m, 1)


def _spans(timeline: ZeroBubbleTimeline) -> tuple[list, list, list]:
    """Per rank, microbatch -> (write slot, last read slot) of its input, residuals and output grad."""
    pp = timeline.forward.shape[1]
    f = [_slots(timeline.forward, r) for r in range(pp)]
    b = [_slots(timeline.backward, r) for r in range(pp)]
    w = [_slots(timeline.weight, r) for r in range(pp)]
    inputs = [{i: (f[r - 1][i], b[r][i]) for i in b[r]} for r in range(1, pp)]
    residuals = [{i: (b[r][i], w[r][i]) for i in w[r]} for r in range(pp)]
    grads = [{i: (b[r + 1][i], w[r][i]) for i in w[r]} for r in range(pp - 1)]
    return inputs, residuals, grads


def zb_h1_buffer_sizes(timeline: ZeroBubbleTimeline) -> ZBBufferSizes:
    """The executor's ring sizes for ``timeline`` (see module docstring)."""
    m = int(max(timeline.forward.max(), 0)) + 1
    inputs, residuals, grads = _spans(timeline)
    return ZBBufferSizes(_ring_size(inputs, m), _ring_size(residuals, m), _ring_size(grads, m))


def live_activation_bound(timeline: ZeroBubbleTimeline) -> np.ndarray:
    """[pp] most microbatches whose activation (stage input or B's residuals) a rank holds at the
    end of any slot: from the input's arrival (rank 0: its F) to the W."""
    pp = timeline.forward.shape[1]
    inputs, residuals, _ = _spans(timeline)
    f0 = _slots(timeline.forward, 0)
    starts = [{i: t - 1 for i, t in f0.items()}] + [{i: s for i, (s, _) in sp.items()} for sp in inputs]
    out = []
    for r in range(pp):
        ends = {i: e for i, (_, e) in residuals[r].items()}
        out.append(max(sum(starts[r][i] <= t < ends[i] for i in ends) for t in range(timeline.num_slots)))
    return np.array(out, np.int64)


class _Residuals:
    """Splits a vjp function into buffered residual leaves and leaves that are the params.

    The split (tree structure and which leaves are params) is fixed at trace time and the same
    for every microbatch; :meth:`split` records it, :meth:`join` rebuilds the vjp function."""

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


def _put(buf: jax.Array, i: jax.Array, value: jax.Array, ok: jax.Array) -> jax.Array:
    """``buf`` with entry ``i`` set to ``value`` where ``ok`` (an in-place update either way)."""
    return buf.at[i].set(jnp.where(ok, value.astype(buf.dtype), buf[i]))


def _zeros(s: jax.ShapeDtypeStruct) -> jax.Array:
    return jnp.zeros(s.shape, s.dtype)


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
) -> tuple:
    """ZB-H1 with :func:`~core.pipeline_parallel.table_driven.execute_stages`' contract (module docstring).

    ``num_model_chunks`` must be 1 and the microbatch count at least the pipeline size. Forward
    only has no backward to split: it runs the 1F1B executor's forward-only table.
    """
    if num_model_chunks != 1:
        raise ValueError(f"ZB-H1 runs one model chunk per pipeline rank, got num_model_chunks {num_model_chunks}")
    if forward_only:
        return execute_stages(stage_step, data, chunk_params, shared_params, forward_only=True, axis_name=axis_name,
                              stage_metrics=stage_metrics, chunk_grad_combine=chunk_grad_combine)
    del microbatch_group_size_per_vp_stage  # one chunk: nothing to group
    pp, m = lax.axis_size(axis_name), jax.tree.leaves(data)[0].shape[0]
    timeline = build_zb_h1_timeline(m, pp)
    sizes = zb_h1_buffer_sizes(timeline)
    rank = lax.axis_index(axis_name)
    is_last = rank == pp - 1
    tables = [jnp.asarray(a) for a in (timeline.forward, timeline.backward, timeline.weight)]
    take = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    run, per_token = stage_runner(stage_step, m, stage_metrics)
    residuals = _Residuals()

    def params():
        return take(chunk_params, 0), shared_params

    def vjp_of(mb, x):
        def f(p, sp, r):
            out, (loss, nt, rd, _) = run(p, sp, take(data, mb), r, rank)
            return (out, loss.astype(jnp.float32)), (nt, rd)

        p, sp = params()
        (_, loss), vjp_fn, (nt, rd) = jax.vjp(f, p, sp, x, has_aux=True)
        return (p, sp), vjp_fn, (loss, nt, rd)

    def cotangents(out_grad):
        # The last stage's output feeds only its own loss: seed the loss, not the output.
        return jnp.where(is_last, jnp.zeros_like(out_grad), out_grad), jnp.where(is_last, 1.0, 0.0).astype(jnp.float32)

    def backward_input(args):
        acts, grads, mb = args
        ps_, vjp_fn, result = vjp_of(mb, acts[mb % sizes.inputs])
        gx = vjp_fn(cotangents(grads[mb % sizes.output_grads]))[2]
        return result, gx, residuals.split(vjp_fn, ps_)

    def backward_weight(args):
        res, grads, mb = args
        ps_ = params()
        vjp_fn = residuals.join([r[mb % sizes.residuals] for r in res], ps_)
        gp, gs, _ = vjp_fn(cotangents(grads[mb % sizes.output_grads]))
        return gp, gs

    def forward(args):
        acts, mb = args
        p, sp = params()
        y, (_, _, _, sm) = run(p, sp, take(data, mb), acts[mb % sizes.inputs], rank)
        return y, sm

    d0 = take(data, 0)
    act_shape, (_, _, rd_shape, sm_shape) = jax.eval_shape(lambda: run(*params(), d0, jnp.zeros(()), 0))
    act_zero = _zeros(act_shape)
    probe = jnp.zeros((sizes.inputs,) + act_zero.shape, act_zero.dtype)
    grad_probe = jnp.zeros((sizes.output_grads,) + act_zero.shape, act_zero.dtype)
    b_shapes = jax.eval_shape(backward_input, (probe, grad_probe, jnp.zeros((), jnp.int32)))
    zeros_of = lambda tree: jax.tree.map(_zeros, tree)
    no_b = zeros_of(b_shapes)
    zero_grads = jax.tree.map(lambda a: jnp.zeros_like(a[0]), chunk_params)
    zero_shared = jax.tree.map(jnp.zeros_like, shared_params)
    fwd_t, bwd_t, w_t = tables

    def slot(carry, t):
        acts, grads, res, param_grads, shared_grads, rds, ntok, sms = carry
        f_mb, b_mb, w_mb = fwd_t[t, rank], bwd_t[t, rank], w_t[t, rank]
        y, sm = lax.cond(f_mb >= 0, forward, lambda _: (act_zero, zeros_of(sm_shape)), (acts, jnp.maximum(f_mb, 0)))
        sms = jax.tree.map(lambda acc, v: acc.at[jnp.maximum(f_mb, 0)].add(v), sms, sm)
        (loss, nt, rd), gx, kept = lax.cond(b_mb >= 0, backward_input, lambda _: no_b,
                                            (acts, grads, jnp.maximum(b_mb, 0)))
        res = [_put(r, jnp.maximum(b_mb, 0) % sizes.residuals, v, b_mb >= 0) for r, v in zip(res, kept, strict=True)]
        hit = (b_mb >= 0) & is_last
        rds = jax.tree.map(lambda acc, v: _put(acc, jnp.maximum(b_mb, 0), v, hit), rds, rd)
        ntok = ntok + jnp.where(hit, nt, 0.0)
        gp, gs = lax.cond(w_mb >= 0, backward_weight, lambda _: (zero_grads, zero_shared),
                          (res, grads, jnp.maximum(w_mb, 0)))
        param_grads = accumulate_chunk_grads(param_grads, gp, 0, chunk_grad_combine)
        shared_grads = jax.tree.map(jnp.add, shared_grads, gs)
        # Activations to the next stage, input gradients to the previous one (ring over ranks).
        prev, nxt = (rank - 1) % pp, (rank + 1) % pp
        recv_y = lax.ppermute(y, axis_name, [(i, (i + 1) % pp) for i in range(pp)])
        sent_f = fwd_t[t, prev]
        acts = _put(acts, jnp.maximum(sent_f, 0) % sizes.inputs, recv_y, (sent_f >= 0) & (rank > 0))
        recv_g = lax.ppermute(gx, axis_name, [(i, (i - 1) % pp) for i in range(pp)])
        sent_b = bwd_t[t, nxt]
        grads = _put(grads, jnp.maximum(sent_b, 0) % sizes.output_grads, recv_g, (sent_b >= 0) & ~is_last)
        return (acts, grads, res, param_grads, shared_grads, rds, ntok, sms), None

    per_mb = lambda tree: jax.tree.map(lambda z: jnp.zeros((m,) + z.shape, z.dtype), tree)
    res0 = [jnp.zeros((sizes.residuals,) + s.shape, s.dtype) for s in b_shapes[2]]
    init = (probe, grad_probe, res0, jax.tree.map(jnp.zeros_like, chunk_params), zero_shared,
            per_mb(zeros_of(rd_shape)), jnp.zeros((), jnp.float32), per_mb(zeros_of(sm_shape)))
    (_, _, _, param_grads, shared_grads, rds, ntok, sms), _ = lax.scan(slot, init, jnp.arange(timeline.num_slots))
    out = ([take(rds, i) for i in range(m)], param_grads, shared_grads, (ntok if per_token["yes"] else None))
    if stage_metrics:
        sms = jax.tree.map(lambda a: lax.psum(a, axis_name), sms)
        out += ([take(sms, i) for i in range(m)],)
    return out


def execute_schedule_zb_h1(
    forward_step_func: Callable,
    data: Any,
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    *,
    forward_only: bool = False,
    axis_name: str = "pp",
) -> tuple[list[dict], Any, jax.Array | None]:
    """ZB-H1 on Megatron's contract (as :func:`~core.pipeline_parallel.table_driven.execute_schedule`,
    ``params`` with a leading ``[1]`` chunk dim); returns ``(losses_reduced, grads, num_tokens)``."""

    def stage_step(p, _shared, d, received, vs):
        out, loss_func = forward_step_func(d, lambda x: stage_fn(p, jnp.where(vs == 0, x, received)))
        return out, loss_func(out)

    losses, grads, _, ntok = execute_stages_zb_h1(stage_step, data, params, None, forward_only=forward_only,
                                                  axis_name=axis_name)
    return losses, grads, ntok
