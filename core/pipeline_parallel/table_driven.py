"""Table-driven SPMD execution of Megatron's 1F1B and interleaved 1F1B schedules.

Every rank runs one ``lax.scan`` over the slots of a :class:`~core.pipeline_parallel.timeline.Timeline`
built from Megatron's per-rank step orders; the static table, indexed by ``lax.axis_index``,
says which (microbatch, chunk) this rank runs forward or backward in the slot (``lax.cond``:
an idle rank computes nothing). Each slot ends with two ring ``ppermute``\\ s, activations to
the next virtual stage and input-gradients to the previous one; receivers read the sender's
table entry to know which (microbatch, chunk) arrived and store it in ring buffers of
``timeline.buffer_size`` entries per chunk. The backward recomputes the chunk's forward inside
``jax.vjp`` from the stashed input, so memory stays O(pp) stage inputs per chunk whatever M.

The slot table reproduces Megatron's bubble: ``(p-1)/(m+p-1)`` of the rank-slots idle for
1F1B and ``(p-1)/(v m + p - 1)`` with ``v`` chunks per rank (``Timeline.bubble_fraction``).

Contract: ``stage_fn(chunk_params, x) -> y`` with ``y.shape == x.shape``; ``loss_fn(y, target)``
on the last virtual stage; ``params`` carries a leading ``[num_model_chunks]`` dimension (this
rank's chunks; chunk ``c`` of rank ``r`` is virtual stage ``c * pp + r``). Each microbatch loss
is divided by ``M`` (the schedule's share of the loss normalisation, see
``core.distributed.finalize_model_grads``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from core.pipeline_parallel.timeline import build_timeline


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
    """Run Megatron's (interleaved) 1F1B order; call inside ``shard_map``.

    Returns ``(loss, grads)``: the mean microbatch loss (on the rank holding the last virtual
    stage, 0 elsewhere) and the grads of this rank's ``[num_model_chunks, ...]`` params.
    """
    pp, vpp = lax.axis_size(axis_name), num_model_chunks
    m = microbatches.shape[0]
    timeline = build_timeline(m, pp, vpp, microbatch_group_size_per_vp_stage)
    k = timeline.buffer_size
    rank = lax.axis_index(axis_name)
    last_vs = pp * vpp - 1
    fwd_table, bwd_table = jnp.asarray(timeline.forward), jnp.asarray(timeline.backward)
    act_zero = jnp.zeros_like(microbatches[0])
    chunk_params = lambda c: jax.tree.map(lambda a: a[c], params)

    def stage_input(acts, mb, c):
        first = (c == 0) & (rank == 0)
        return jnp.where(first, microbatches[mb], acts[c, mb % k])

    def forward(args):
        acts, mb, c = args
        return stage_fn(chunk_params(c), stage_input(acts, mb, c))

    def backward(args):
        acts, grads, mb, c = args
        x = stage_input(acts, mb, c)
        target = jax.tree.map(lambda a: a[mb], targets)

        def on_last(_):
            loss, vjp = jax.vjp(lambda p, x: loss_fn(stage_fn(p, x), target) / m, chunk_params(c), x)
            return (loss, *vjp(jnp.ones((), loss.dtype)))

        def on_other(_):
            _, vjp = jax.vjp(stage_fn, chunk_params(c), x)
            return (jnp.zeros((), jnp.float32), *vjp(grads[c, mb % k]))

        return lax.cond(c * pp + rank == last_vs, on_last, on_other, None)

    def idle_backward(_):
        return jnp.zeros((), jnp.float32), jax.tree.map(lambda a: jnp.zeros_like(a[0]), params), act_zero

    def slot(carry, t):
        acts, grads, param_grads, loss_sum = carry
        f_mb, f_c = jnp.divmod(jnp.maximum(fwd_table[t, rank], 0), vpp)
        b_mb, b_c = jnp.divmod(jnp.maximum(bwd_table[t, rank], 0), vpp)
        y = lax.cond(fwd_table[t, rank] >= 0, forward, lambda _: act_zero, (acts, f_mb, f_c))
        loss, gp, gx = lax.cond(bwd_table[t, rank] >= 0, backward, idle_backward, (acts, grads, b_mb, b_c))
        param_grads = jax.tree.map(lambda acc, g: acc.at[b_c].add(g), param_grads, gp)
        # Activations to the next virtual stage, input-grads to the previous one (ring over ranks).
        recv_y = lax.ppermute(y, axis_name, [(i, (i + 1) % pp) for i in range(pp)])
        recv_g = lax.ppermute(gx, axis_name, [(i, (i - 1) % pp) for i in range(pp)])
        prev, nxt = (rank - 1) % pp, (rank + 1) % pp
        s_f, s_b = fwd_table[t, prev], bwd_table[t, nxt]
        sf_mb, sf_c = jnp.divmod(jnp.maximum(s_f, 0), vpp)
        sb_mb, sb_c = jnp.divmod(jnp.maximum(s_b, 0), vpp)
        dest_f = sf_c + (prev == pp - 1)  # rank pp-1's chunk c feeds rank 0's chunk c+1
        dest_b = sb_c - (nxt == 0)  # rank 0's chunk c sends grads to rank pp-1's chunk c-1
        ok_f = (s_f >= 0) & (sf_c * pp + prev < last_vs)
        ok_b = (s_b >= 0) & (sb_c * pp + nxt > 0)
        acts = jnp.where(ok_f, acts.at[jnp.clip(dest_f, 0, vpp - 1), sf_mb % k].set(recv_y), acts)
        grads = jnp.where(ok_b, grads.at[jnp.clip(dest_b, 0, vpp - 1), sb_mb % k].set(recv_g), grads)
        return (acts, grads, param_grads, loss_sum + loss), None

    buffers = jnp.zeros((vpp, k) + act_zero.shape, act_zero.dtype)
    init = (buffers, buffers, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
    (_, _, param_grads, loss), _ = lax.scan(slot, init, jnp.arange(timeline.num_slots))
    return loss, param_grads
