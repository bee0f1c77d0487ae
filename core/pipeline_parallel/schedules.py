"""Megatron's forward-backward API: ``get_forward_backward_func`` and the schedules it returns.

Contract (Megatron's, adapted to functional JAX):

* ``forward_step_func(data, model) -> (output, loss_func)``; ``data`` is one microbatch taken
  from ``data_iterator`` and ``model`` a callable ``model(x) -> y``. In a pipeline the model
  object is the *stage*: on stage 0 it consumes ``x``, on later stages it ignores ``x`` and
  consumes the activation received from the previous stage (Megatron's ``set_input_tensor``).
* ``loss_func(output) -> (loss, reduced_loss_dict)`` or ``(loss_sum, num_tokens, dict)``.
* ``model`` is ``(stage_fn, params)`` with ``stage_fn(params, x) -> y``; gradients are taken
  with respect to ``params`` (the stage's own parameters in a pipeline). Or, as in Megatron's
  loop, ``model`` is a ``DistributedDataParallel`` (or a list of one): then the call is made
  outside ``shard_map`` with global microbatches, runs as one jitted program over the mesh,
  accumulates the grads in the DDP's grad buffers and returns the loss dicts averaged over
  data parallelism (``DistributedDataParallel.run_forward_backward``).
* Returns ``(losses_reduced, grads, num_tokens)``: Megatron's list of one reduced-loss dict per
  microbatch (valid on the last stage; zeros on other stages in SPMD), the parameter grads
  (``None`` when ``forward_only``) and the summed token count (``None`` without per-token loss).

Loss scaling, applied exactly once (see ``core/distributed/finalize_model_grads.py``): with
``(loss, dict)`` each microbatch loss is divided by ``num_microbatches`` here; with
``(loss_sum, num_tokens, dict)`` nothing is divided here and ``finalize_model_grads`` divides by
the global token count. Data-parallel averaging is DDP's job.

The pipelined schedules must be called inside ``shard_map`` over the ``"pp"`` axis; the
``data_iterator`` is read at trace time (``num_microbatches`` items, stacked), so it should yield
the shard_map-local microbatch slices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from core import parallel_state as ps
from core.pipeline_parallel.table_driven import execute_schedule, split_loss
from core.pipeline_parallel.zero_bubble_executor import execute_schedule_zb_h1, execute_schedule_zb_v


def _ddp_model(model: Any) -> Any:
    """The ``DistributedDataParallel`` when ``model`` is one (or Megatron's list of one chunk),
    else None: then the schedule runs itself, Megatron's way (see ``run_forward_backward``)."""
    chunks = model if isinstance(model, list) else [model]
    ddp = [c for c in chunks if hasattr(c, "run_forward_backward")]
    if not ddp:
        return None
    if len(chunks) != 1:
        raise ValueError(f"model: one DistributedDataParallel chunk per call, got a list of {len(chunks)}; "
                         "interleaved chunks go as (stage_fn, params) pairs inside shard_map")
    return ddp[0]


def _take(data_iterator: Iterator, num_microbatches: int) -> Any:
    items = [next(data_iterator) for _ in range(num_microbatches)]
    return jax.tree.map(lambda *a: jnp.stack(a), *items)


def _unstack(stacked: dict, n: int) -> list[dict]:
    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)]


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator: Iterator, model: tuple,
                                   num_microbatches: int, seq_length: int | None = None,
                                   micro_batch_size: int | None = None, forward_only: bool = False):
    """All microbatches through the whole model on this rank, one after another, grads accumulated.

    As Megatron's loop, a ``lax.scan`` runs one microbatch's forward and backward per iteration,
    so activation memory is one microbatch's whatever ``num_microbatches`` (the point of
    gradient accumulation).
    """
    if (ddp := _ddp_model(model)) is not None:
        return ddp.run_forward_backward(forward_backward_no_pipelining, forward_step_func=forward_step_func,
                                        data_iterator=data_iterator, num_microbatches=num_microbatches,
                                        forward_only=forward_only)
    del seq_length, micro_batch_size  # shapes come from the data in JAX
    stage_fn, params = model
    data = _take(data_iterator, num_microbatches)

    def one(p, d):
        out, loss_func = forward_step_func(d, lambda *a, **k: stage_fn(p, *a, **k))
        loss, nt, rd = split_loss(loss_func(out), num_microbatches)
        return loss, (nt if nt is not None else jnp.zeros(()), rd)

    def forward(acc, d):
        return acc, one(params, d)[1]

    def forward_backward(acc, d):
        (_, aux), grads = jax.value_and_grad(one, has_aux=True)(params, d)
        return jax.tree.map(jnp.add, acc, grads), aux

    if forward_only:
        grads, (nts, rds) = lax.scan(forward, None, data)
    else:
        grads, (nts, rds) = lax.scan(forward_backward, jax.tree.map(jnp.zeros_like, params), data)
    d0 = jax.tree.map(lambda a: a[0], data)
    per_token = _returns_num_tokens(forward_step_func, d0, stage_fn, params)  # traced once; dead code for XLA
    return _unstack(rds, num_microbatches), grads, (jnp.sum(nts) if per_token else None)


def _returns_num_tokens(forward_step_func, d, stage_fn, params) -> bool:
    out, loss_func = forward_step_func(d, lambda x: stage_fn(params, x))
    return len(loss_func(out)) == 3


def forward_backward_pipelining_without_interleaving(*, forward_step_func: Callable, data_iterator: Iterator,
                                                     model: tuple, num_microbatches: int,
                                                     seq_length: int | None = None,
                                                     micro_batch_size: int | None = None,
                                                     forward_only: bool = False, axis_name: str = "pp"):
    """Megatron's 1F1B (warm-up ``min(pp - rank - 1, M)``, steady 1F1B, cool-down) over ``axis_name``.

    Runs Megatron's exact order with the table-driven executor
    (:mod:`core.pipeline_parallel.table_driven`). Call inside ``shard_map``; ``model =
    (stage_fn, stage_params)`` with homogeneous stages (``y.shape == x.shape``).
    """
    if (ddp := _ddp_model(model)) is not None:
        return ddp.run_forward_backward(forward_backward_pipelining_without_interleaving,
                                        forward_step_func=forward_step_func, data_iterator=data_iterator,
                                        num_microbatches=num_microbatches, forward_only=forward_only,
                                        axis_name=axis_name)
    del seq_length, micro_batch_size
    stage_fn, params = model
    losses, grads, ntok = execute_schedule(
        forward_step_func, _take(data_iterator, num_microbatches), stage_fn, jax.tree.map(lambda a: a[None], params),
        forward_only=forward_only, axis_name=axis_name)
    return losses, (None if grads is None else jax.tree.map(lambda a: a[0], grads)), ntok


def forward_backward_pipelining_with_interleaving(*, forward_step_func: Callable, data_iterator: Iterator | list,
                                                  model: tuple | list, num_microbatches: int,
                                                  seq_length: int | None = None,
                                                  micro_batch_size: int | None = None,
                                                  forward_only: bool = False,
                                                  microbatch_group_size_per_vp_stage: int | None = None,
                                                  axis_name: str = "pp"):
    """Megatron's interleaved 1F1B: ``model`` is a list of ``(stage_fn, chunk_params)`` (one per
    model chunk, chunk ``c`` of rank ``r`` = virtual stage ``c * pp + r``) or ``(stage_fn, params)``
    with a leading ``[vpp]`` dim; ``data_iterator`` one iterator (or Megatron's list, of which the
    first is read). Grads come back in the same form as ``model``'s params.
    """
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if (ddp := _ddp_model(model)) is not None:
        return ddp.run_forward_backward(forward_backward_pipelining_with_interleaving,
                                        forward_step_func=forward_step_func, data_iterator=data_iterator,
                                        num_microbatches=num_microbatches, forward_only=forward_only,
                                        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
                                        axis_name=axis_name)
    del seq_length, micro_batch_size

    def execute(stage_fn, data, params, vpp):
        return execute_schedule(forward_step_func, data, stage_fn, params, num_model_chunks=vpp,
                                forward_only=forward_only,
                                microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
                                axis_name=axis_name)

    return _run_chunks(execute, model, _take(data_iterator, num_microbatches))


def _run_chunks(execute: Callable, model: tuple | list, data: Any) -> tuple:
    """``execute(stage_fn, data, params with a leading [vpp] dim, vpp)`` on ``model`` given as a
    list of ``(stage_fn, chunk_params)`` or as ``(stage_fn, stacked params)``; the grads come back
    in the same form as ``model``'s params."""
    chunks = isinstance(model, list)
    stage_fn = model[0][0] if chunks else model[0]
    params = jax.tree.map(lambda *a: jnp.stack(a), *[p for _, p in model]) if chunks else model[1]
    vpp = jax.tree.leaves(params)[0].shape[0]
    losses, grads, ntok = execute(stage_fn, data, params, vpp)
    if chunks and grads is not None:
        grads = [jax.tree.map(lambda a, c=c: a[c], grads) for c in range(vpp)]
    return losses, grads, ntok


def forward_backward_pipelining_zero_bubble(*, forward_step_func: Callable, data_iterator: Iterator, model: tuple,
                                            num_microbatches: int, seq_length: int | None = None,
                                            micro_batch_size: int | None = None, forward_only: bool = False,
                                            axis_name: str = "pp", w_recompute: bool = False):
    """ZB-H1 zero-bubble pipelining over ``axis_name`` (Qi et al., ICLR 2024), with
    :func:`forward_backward_pipelining_without_interleaving`'s contract: each backward runs as B
    (the input gradient, sent upstream at once) and a later W (the weight gradient, filling the
    cool-down bubble); :mod:`core.pipeline_parallel.zero_bubble_executor`. Needs
    ``num_microbatches >= pp``; returns the same losses, grads and token count as 1F1B.
    ``w_recompute``: W recomputes the stage's forward from its input instead of keeping B's
    residuals (1F1B's activation memory for one more forward per microbatch)."""
    if (ddp := _ddp_model(model)) is not None:
        return ddp.run_forward_backward(forward_backward_pipelining_zero_bubble,
                                        forward_step_func=forward_step_func, data_iterator=data_iterator,
                                        num_microbatches=num_microbatches, forward_only=forward_only,
                                        axis_name=axis_name, w_recompute=w_recompute)
    del seq_length, micro_batch_size
    stage_fn, params = model
    losses, grads, ntok = execute_schedule_zb_h1(
        forward_step_func, _take(data_iterator, num_microbatches), stage_fn, jax.tree.map(lambda a: a[None], params),
        forward_only=forward_only, axis_name=axis_name, w_recompute=w_recompute)
    return losses, (None if grads is None else jax.tree.map(lambda a: a[0], grads)), ntok


def forward_backward_pipelining_zero_bubble_v(*, forward_step_func: Callable, data_iterator: Iterator | list,
                                              model: tuple | list, num_microbatches: int,
                                              seq_length: int | None = None, micro_batch_size: int | None = None,
                                              forward_only: bool = False, axis_name: str = "pp",
                                              w_recompute: bool = False):
    """ZB-V zero-bubble pipelining over ``axis_name`` (Qi et al., ICLR 2024) with
    :func:`forward_backward_pipelining_with_interleaving`'s contract for two chunks, placed in a V:
    chunk 0 of rank ``r`` is virtual stage ``r``, chunk 1 is ``2 pp - 1 - r`` (the first and last
    stages on rank 0); each backward runs as B and a later W
    (:func:`~core.pipeline_parallel.zero_bubble_executor.execute_stages_zb_v`). Needs
    ``num_microbatches >= pp``; ``w_recompute`` as for
    :func:`forward_backward_pipelining_zero_bubble`."""
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if (ddp := _ddp_model(model)) is not None:
        return ddp.run_forward_backward(forward_backward_pipelining_zero_bubble_v,
                                        forward_step_func=forward_step_func, data_iterator=data_iterator,
                                        num_microbatches=num_microbatches, forward_only=forward_only,
                                        axis_name=axis_name, w_recompute=w_recompute)
    del seq_length, micro_batch_size

    def execute(stage_fn, data, params, vpp):
        if vpp != 2:
            raise ValueError(f"ZB-V runs two model chunks per pipeline rank, got {vpp}")
        return execute_schedule_zb_v(forward_step_func, data, stage_fn, params, forward_only=forward_only,
                                     axis_name=axis_name, w_recompute=w_recompute)

    return _run_chunks(execute, model, _take(data_iterator, num_microbatches))


SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v")
"""The names :func:`get_forward_backward_func` takes (``--pipeline-schedule``'s choices)."""


def get_forward_backward_func(state: ps.ParallelState | None = None, schedule: str | None = None) -> Callable:
    """Pick the schedule by the pipeline and virtual-pipeline sizes, as Megatron does, or by
    ``schedule`` (one of :data:`SCHEDULES`; ``"zb-h1"`` and ``"1f1b"`` need one chunk per stage,
    ``"interleaved"`` more, ``"zb-v"`` two). Without pipelining every schedule is the plain
    microbatch loop."""
    state = state if state is not None else ps.get_parallel_state()
    pp = state.pipeline_model_parallel_size
    vpp = getattr(state, "virtual_pipeline_model_parallel_size", None) or 1
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if pp == 1:
        return forward_backward_no_pipelining
    fits = {"interleaved": vpp > 1, "zb-v": vpp == 2}.get(schedule, vpp == 1)
    if schedule is not None and not fits:
        raise ValueError(f"schedule {schedule!r} does not fit virtual_pipeline_model_parallel_size {vpp} "
                         "(interleaved needs > 1, zb-v 2, the others 1)")
    if schedule == "zb-v":
        return forward_backward_pipelining_zero_bubble_v
    if vpp > 1:
        return forward_backward_pipelining_with_interleaving
    if schedule == "zb-h1":
        return forward_backward_pipelining_zero_bubble
    return forward_backward_pipelining_without_interleaving
