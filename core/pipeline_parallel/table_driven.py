"""Table-driven SPMD execution of Megatron's 1F1B and interleaved 1F1B schedules.

Every rank runs one ``lax.scan`` over the slots of a :class:`~core.pipeline_parallel.timeline.Timeline`
built from Megatron's per-rank step orders; the static table, indexed by ``lax.axis_index``,
says which (microbatch, chunk) this rank runs forward or backward in the slot (``lax.cond``:
an idle rank computes nothing). Each slot ends with two ring ``ppermute``\\ s, activations to
the next virtual stage and input-gradients to the previous one, each skipped in the slots where
no rank sends that way (:func:`skippable_ppermute`); receivers read the sender's
table entry to know which (microbatch, chunk) arrived and store it in ring buffers of
``timeline.buffer_size`` entries per chunk. The backward recomputes the chunk's forward inside
``jax.vjp`` from the stashed input, so memory stays O(pp) stage inputs per chunk whatever M.

The slot table reproduces Megatron's bubble: ``(p-1)/(m+p-1)`` of the rank-slots idle for
1F1B and ``(p-1)/(v m + p - 1)`` with ``v`` chunks per rank (``Timeline.bubble_fraction``).

Two entry points share the executor:

* :func:`execute_schedule` — Megatron's contract (used by ``schedules.py``):
  ``forward_step_func(microbatch, model) -> (output, loss_func)``, ``loss_func(output)`` returns
  ``(loss, dict)`` (divided by ``num_microbatches`` here) or ``(loss_sum, num_tokens, dict)``
  (not divided: ``finalize_model_grads`` divides by the global token count);
* :func:`forward_backward_table_driven` — a plain ``stage_fn`` / ``loss_fn`` form.

:func:`execute_stages` can also sum a ``stage_metrics`` dict over every virtual stage (e.g. the
MoE losses of each chunk's layers), where ``losses_reduced`` only holds the last stage's.

ZB-H1 and ZB-V (the backward split into an input-gradient B and a later weight-gradient W; ZB-V
with its own V placement of the two chunks) run the same contract in
:mod:`core.pipeline_parallel.zero_bubble_executor`, on :func:`stage_runner` and
:func:`accumulate_chunk_grads`.

``params`` carries a leading ``[num_model_chunks]`` dimension (this rank's chunks; chunk ``c``
of rank ``r`` is virtual stage ``c * pp + r``); stages keep the activation shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from core.pipeline_parallel.timeline import build_timeline


def split_loss(result: tuple, num_microbatches: int) -> tuple[jax.Array, jax.Array | None, dict]:
    """``loss_func``'s result as (scaled loss, num_tokens or None, reduced dict); see module doc."""
    if len(result) == 3:
        loss, num_tokens, reduced = result
        return loss, jnp.asarray(num_tokens, jnp.float32), reduced
    if len(result) == 2:
        loss, reduced = result
        return loss / num_microbatches, None, reduced
    raise ValueError(f"loss_func must return (loss, dict) or (loss, num_tokens, dict), got {len(result)} items")


def stage_runner(stage_step: Callable, num_microbatches: int, stage_metrics: bool) -> tuple[Callable, dict]:
    """``stage_step`` normalised for the executors: ``run(p, sp, d, received, vs) -> (out, (loss,
    num_tokens, reduced, metrics))`` with the loss scaled by :func:`split_loss` (zero tokens and
    empty metrics where absent), and a dict whose ``"yes"`` says, once traced, whether
    ``loss_func`` returns a token count."""
    per_token: dict[str, bool] = {}

    def run(p, sp, d, received, vs):
        out, result, *sm = stage_step(p, sp, d, received, vs)
        if len(sm) != int(stage_metrics):
            raise ValueError(f"stage_step must return {3 if stage_metrics else 2} items with "
                             f"stage_metrics={stage_metrics}, got {2 + len(sm)}")
        loss, nt, reduced = split_loss(result, num_microbatches)
        per_token["yes"] = nt is not None
        return out, (loss, jnp.zeros((), jnp.float32) if nt is None else nt, reduced, sm[0] if sm else {})

    return run, per_token


def skippable_ppermute(x: jax.Array, anyone_sends: jax.Array, axis_name: str, pairs: list) -> jax.Array:
    """``lax.ppermute(x, axis_name, pairs)``, or zeros without a transfer where ``anyone_sends``
    is false. The predicate must be the same on every rank (a function of the slot alone), so all
    ranks take the same branch: a schedule's slots where no rank sends that way cost nothing."""
    return lax.cond(anyone_sends, lambda v: lax.ppermute(v, axis_name, pairs), jnp.zeros_like, x)


def _slots_sending(timeline: Any, pp: int, vpp: int) -> tuple[np.ndarray, np.ndarray]:
    """[slots] whether any rank sends an activation (a forward below the last virtual stage) and
    whether any sends an input gradient (a backward above the first) in each slot."""
    rank, last = np.arange(pp), pp * vpp - 1
    f, b = timeline.forward, timeline.backward
    f_sends = (f >= 0) & ((np.maximum(f, 0) % vpp) * pp + rank < last)
    b_sends = (b >= 0) & ((np.maximum(b, 0) % vpp) * pp + rank > 0)
    return f_sends.any(axis=1), b_sends.any(axis=1)


def accumulate_chunk_grads(acc: Any, g: Any, c: jax.Array | int, combine: Any = None) -> Any:
    """``acc`` (``[vpp, ...]`` leaves) with chunk ``c``'s cotangents ``g`` added, or max-combined
    where the ``combine`` prefix tree says ``"max"`` (see :func:`execute_stages`)."""
    if combine is None:
        return jax.tree.map(lambda a, x: a.at[c].add(x), acc, g)
    if any(how not in ("sum", "max") for how in jax.tree.leaves(combine)):
        raise ValueError(f"chunk_grad_combine leaves must be 'sum' or 'max', got {combine!r}")
    one = lambda how, a, x: a.at[c].max(x) if how == "max" else a.at[c].add(x)
    return jax.tree.map(lambda how, a, x: jax.tree.map(functools.partial(one, how), a, x), combine, acc, g)


def execute_schedule(
    forward_step_func: Callable,
    data: Any,
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    *,
    num_model_chunks: int = 1,
    forward_only: bool = False,
    microbatch_group_size_per_vp_stage: int | None = None,
    axis_name: str = "pp",
) -> tuple[list[dict], Any, jax.Array | None]:
    """Megatron's (interleaved) 1F1B on stacked microbatch ``data`` (leading dim M); inside ``shard_map``.

    Returns ``(losses_reduced, grads, num_tokens)``: one reduced-loss dict per microbatch (valid
    on the rank holding the last virtual stage, zeros elsewhere), this rank's ``[vpp, ...]``
    grads (None when ``forward_only``) and the summed token count (None without per-token loss).
    """

    def stage_step(p, _shared, d, received, vs):
        # Megatron's set_input_tensor: virtual stage 0 reads the data, the others the received activation.
        out, loss_func = forward_step_func(d, lambda x: stage_fn(p, jnp.where(vs == 0, x, received)))
        return out, loss_func(out)

    losses, grads, _, ntok = execute_stages(
        stage_step, data, params, None, num_model_chunks=num_model_chunks, forward_only=forward_only,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage, axis_name=axis_name)
    return losses, grads, ntok


def execute_stages(
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
) -> tuple[list[dict], Any, Any, jax.Array | None] | tuple[list[dict], Any, Any, jax.Array | None, list[dict]]:
    """The executor, for models whose first and last stages differ (embedding, output layer).

    ``stage_step(chunk_params, shared_params, microbatch, received, virtual_stage)`` returns
    ``(output_activation, loss_result)``: ``received`` is the activation from the previous
    virtual stage (garbage on virtual stage 0, which reads ``microbatch`` instead), and
    ``loss_result`` is what Megatron's ``loss_func`` returns (used on the last virtual stage
    only). ``chunk_params`` have a leading ``[num_model_chunks]`` dim (this rank's chunks);
    ``shared_params`` are used by every chunk (e.g. a tied embedding) and their grads are summed.
    Returns ``(losses_reduced, chunk_grads, shared_grads, num_tokens)``.

    ``stage_metrics``: ``stage_step`` returns ``(output_activation, loss_result, metrics)``, a
    dict of arrays from every virtual stage (keep the gradient out: they are only recorded),
    and a fifth element is returned: one dict per microbatch, summed over the virtual stages
    (the forward of every (microbatch, chunk) counts once) and over ``axis_name``, so every
    pipeline rank holds the whole model's values.

    ``chunk_grad_combine``: how the microbatches' chunk cotangents combine, as a pytree prefix of
    ``chunk_params`` with ``"sum"`` (gradients; the default for everything) or ``"max"`` leaves
    (statistics reported through cotangents, e.g. FP8 amaxes: :mod:`core.fp8.linear`).
    """
    pp, vpp = lax.axis_size(axis_name), num_model_chunks
    m = jax.tree.leaves(data)[0].shape[0]
    timeline = build_timeline(m, pp, vpp, microbatch_group_size_per_vp_stage, forward_only)
    k = timeline.buffer_size
    rank = lax.axis_index(axis_name)
    last_vs = pp * vpp - 1
    fwd_table, bwd_table = jnp.asarray(timeline.forward), jnp.asarray(timeline.backward)
    f_sends, b_sends = (jnp.asarray(a) for a in _slots_sending(timeline, pp, vpp))
    take = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    shared = shared_params

    run, per_token = stage_runner(stage_step, m, stage_metrics)

    d0 = take(data, 0)
    out_shape, (_, _, rd_shape, sm_shape) = jax.eval_shape(
        lambda: run(take(chunk_params, 0), shared, d0, jnp.zeros(()), 0))
    act_zero = jnp.zeros(out_shape.shape, out_shape.dtype)
    zeros_of = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
    zeros_rd, zeros_sm = zeros_of(rd_shape), zeros_of(sm_shape)
    no_loss = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros_rd, zeros_sm)

    def unpack(code):
        mb, c = jnp.divmod(jnp.maximum(code, 0), vpp)
        return mb, c, c * pp + rank

    def forward(args):
        acts, code = args
        mb, c, vs = unpack(code)
        y, (loss, nt, rd, sm) = run(take(chunk_params, c), shared, take(data, mb), acts[c, mb % k], vs)
        return y, (loss.astype(jnp.float32), nt, rd, sm)

    def backward(args):
        acts, grads, code = args
        mb, c, vs = unpack(code)
        is_last = vs == last_vs

        def f(p, sp, r):
            out, (loss, nt, rd, _) = run(p, sp, take(data, mb), r, vs)
            return (out, loss), (nt, rd)

        (_, loss), vjp, (nt, rd) = jax.vjp(f, take(chunk_params, c), shared, acts[c, mb % k], has_aux=True)
        cot_out = jnp.where(is_last, jnp.zeros_like(act_zero), grads[c, mb % k])
        gp, gs, gx = vjp((cot_out, jnp.where(is_last, 1.0, 0.0).astype(loss.dtype)))
        return (loss.astype(jnp.float32), nt, rd, zeros_sm), gp, gs, gx

    def backward_step(args):
        acts, grads, code, param_grads, shared_grads = args
        b_res, gp, gs, gx = backward((acts, grads, code))
        param_grads = accumulate_chunk_grads(param_grads, gp, unpack(code)[1], chunk_grad_combine)
        return b_res, param_grads, jax.tree.map(jnp.add, shared_grads, gs), gx

    zero_shared = jax.tree.map(jnp.zeros_like, shared)

    def record(rds, ntok, code, result):
        mb, _, vs = unpack(code)
        hit = (code >= 0) & (vs == last_vs)
        _, nt, rd, _ = result
        rds = jax.tree.map(lambda acc, v: jnp.where(hit, acc.at[mb].set(v), acc), rds, rd)
        return rds, ntok + jnp.where(hit, nt, 0.0)

    def slot(carry, t):
        acts, grads, param_grads, shared_grads, rds, ntok, sms = carry
        f_code, b_code = fwd_table[t, rank], bwd_table[t, rank]
        y, f_res = lax.cond(f_code >= 0, forward, lambda _: (act_zero, no_loss), (acts, f_code))
        # Stage metrics of every virtual stage, from its forward (an idle slot adds zeros).
        f_mb = jnp.maximum(f_code, 0) // vpp
        sms = jax.tree.map(lambda acc, v: acc.at[f_mb].add(v), sms, f_res[3])
        if forward_only:
            rds, ntok = record(rds, ntok, f_code, f_res)
            gx = act_zero
        else:
            # The accumulators go through the cond: an idle slot returns them as they are (no
            # zero-filled gradients to add).
            b_res, param_grads, shared_grads, gx = lax.cond(
                b_code >= 0, backward_step, lambda a: (no_loss, a[3], a[4], act_zero),
                (acts, grads, b_code, param_grads, shared_grads))
            rds, ntok = record(rds, ntok, b_code, b_res)
        # Activations to the next virtual stage, input-grads to the previous one (ring over ranks).
        recv_y = skippable_ppermute(y, f_sends[t], axis_name, [(i, (i + 1) % pp) for i in range(pp)])
        prev, nxt = (rank - 1) % pp, (rank + 1) % pp
        sf_mb, sf_c = jnp.divmod(jnp.maximum(fwd_table[t, prev], 0), vpp)
        ok_f = (fwd_table[t, prev] >= 0) & (sf_c * pp + prev < last_vs)
        dest_f = jnp.clip(sf_c + (prev == pp - 1), 0, vpp - 1)  # rank pp-1's chunk c feeds rank 0's chunk c+1
        acts = acts.at[dest_f, sf_mb % k].set(jnp.where(ok_f, recv_y, acts[dest_f, sf_mb % k]))  # in place
        if not forward_only:
            recv_g = skippable_ppermute(gx, b_sends[t], axis_name, [(i, (i - 1) % pp) for i in range(pp)])
            sb_mb, sb_c = jnp.divmod(jnp.maximum(bwd_table[t, nxt], 0), vpp)
            ok_b = (bwd_table[t, nxt] >= 0) & (sb_c * pp + nxt > 0)
            dest_b = jnp.clip(sb_c - (nxt == 0), 0, vpp - 1)  # rank 0's chunk c sends to rank pp-1's chunk c-1
            grads = grads.at[dest_b, sb_mb % k].set(jnp.where(ok_b, recv_g, grads[dest_b, sb_mb % k]))
        return (acts, grads, param_grads, shared_grads, rds, ntok, sms), None

    buffers = jnp.zeros((vpp, k) + act_zero.shape, act_zero.dtype)
    per_mb = lambda tree: jax.tree.map(lambda z: jnp.zeros((m,) + z.shape, z.dtype), tree)
    init = (buffers, buffers, jax.tree.map(jnp.zeros_like, chunk_params), zero_shared, per_mb(zeros_rd),
            jnp.zeros((), jnp.float32), per_mb(zeros_sm))
    (_, _, param_grads, shared_grads, rds, ntok, sms), _ = lax.scan(slot, init, jnp.arange(timeline.num_slots))
    losses = [take(rds, i) for i in range(m)]
    if forward_only:
        param_grads = shared_grads = None
    out = (losses, param_grads, shared_grads, (ntok if per_token["yes"] else None))
    if stage_metrics:
        sms = jax.tree.map(lambda a: lax.psum(a, axis_name), sms)
        out += ([take(sms, i) for i in range(m)],)
    return out


def forward_backward_table_driven(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    loss_fn: Callable[[jax.Array, Any], jax.Array],
    params: Any,
    microbatches: jax.Array,
    targets: Any,
    *,
    num_model_chunks: int = 1,
    microbatch_group_size_per_vp_stage: int | None = None,
    axis_name: str = "pp",
) -> tuple[jax.Array, Any]:
    """``stage_fn(chunk_params, x)`` / ``loss_fn(y, target)`` form of :func:`execute_schedule`.

    Returns ``(loss, grads)``: the mean microbatch loss (on the rank holding the last virtual
    stage, 0 elsewhere) and the grads of this rank's ``[num_model_chunks, ...]`` params.
    """

    def forward_step_func(d, model):
        out = model(d["x"])
        return out, lambda y: (loss_fn(y, d["t"]), {"loss": loss_fn(y, d["t"])})

    losses, grads, _ = execute_schedule(
        forward_step_func, {"x": microbatches, "t": targets}, stage_fn, params, num_model_chunks=num_model_chunks,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage, axis_name=axis_name)
    return jnp.mean(jnp.stack([d["loss"] for d in losses])), grads
