"""``finalize_model_grads``: every cross-rank gradient reduction of a training step, in order.

Loss normalisation — the one place it is defined
-------------------------------------------------
The training objective is the mean loss over the global batch (all microbatches on all
data-parallel ranks). Three factors produce it, each applied exactly once:

1. the forward step / pipeline schedule divides each microbatch's (mean) loss by
   ``num_microbatches`` before differentiating it (Megatron's ``loss / num_microbatches``;
   times ``cp`` with context parallelism, as Megatron);
2. the data-parallel reduction (:mod:`core.distributed.grad_sync`) sums grads over the
   data-parallel (x context-parallel) group and divides by its size ``dp*cp`` (pre-scale, or
   an average in the collective);
3. with per-token losses instead (the loss function returns a *sum* over tokens and the
   token count), steps 1-2 use factor 1 and this function divides the summed gradients by
   the global token count, ``num_tokens`` all-reduced over data (+context) parallelism.

Model-parallel reductions, SPMD form of Megatron's groups
---------------------------------------------------------
* tensor parallelism: grads of ``sequence_parallel`` params (norms and row-parallel biases
  fed by sequence shards) and of ``tp_partial_grad`` params (the q/k norms, applied to each
  rank's heads) are partial per tp rank and are summed over ``"tp"``;
* pipeline parallelism: every stage runs the same program, so a parameter that is not split
  over ``"pp"`` (the tied word embedding used by the first stage's lookup and the last
  stage's output layer, position embeddings, ...) exists on every stage and receives
  gradient only where it is used; summing over ``"pp"`` is Megatron's embedding-group
  all-reduce, and it keeps all copies identical;
* data parallelism: one all-reduce / reduce-scatter per bucket (Megatron's
  ``finish_grad_sync``), expert buffers over the expert-data-parallel group.

All three are sums, so their order does not change the result; the model-parallel ones run
on the (small) affected parameters first, the data-parallel one per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.grad_sync import reduce_gradients
from core.distributed.param_and_grad_buffer import BufferSpec
from core.parallel_state import PP_AXIS, TP_AXIS, ParallelState
from core.param_metadata import ParamInfo


def allreduce_model_parallel_grads(
    grad_leaves: Sequence[jax.Array], infos: Sequence[ParamInfo], state: ParallelState
) -> list[jax.Array]:
    """Sum tp-partial grads (sequence-parallel, per-head) over tp and pipeline-replicated grads over pp."""
    out = list(grad_leaves)
    for i, info in enumerate(infos):
        if info.grad_summed_over_tp and state.tensor_model_parallel_size > 1:
            out[i] = lax.psum(out[i], TP_AXIS)
        if state.pipeline_model_parallel_size > 1 and not info.split_over(PP_AXIS):
            out[i] = lax.psum(out[i], PP_AXIS)
    return out


def finalize_model_grads(model: Any, *args: Any, **kwargs: Any) -> Any:
    """Megatron's ``finalize_model_grads(model, num_tokens=None)``, or its functional form.

    * ``model`` a list of ``DistributedDataParallel`` model chunks (or one), outside
      ``shard_map``: finish every chunk's grad sync (the data-parallel reduction of its grad
      buffers with the model-parallel sums of :func:`reduce_model_grads`) and, with
      ``num_tokens`` (the global token count of a per-token loss: the loss functions returned
      summed losses), divide the gradients by it, as Megatron's loop does after
      ``forward_backward_func``. Returns None; ``optimizer_step`` reads the result.
    * ``model`` a sequence of gradient arrays, inside ``shard_map``: the functional form,
      :func:`reduce_model_grads` ``(grad_leaves, infos, specs, ddp_config, state, num_tokens)``.
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if chunks and all(hasattr(c, "finish_grad_sync") for c in chunks):
        return _finalize_model_chunks(chunks, *args, **kwargs)
    return reduce_model_grads(model, *args, **kwargs)


def _finalize_model_chunks(model_chunks: Sequence[Any], num_tokens: Any = None) -> None:
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    if num_tokens is not None:
        for chunk in model_chunks:
            chunk.scale_gradients(chunk.per_token_scale(num_tokens))


def reduce_model_grads(
    grad_leaves: Sequence[jax.Array],
    infos: Sequence[ParamInfo],
    specs: Sequence[BufferSpec],
    ddp_config: DistributedDataParallelConfig,
    state: ParallelState,
    num_tokens: jax.Array | None = None,
) -> list[jax.Array] | tuple[tuple[jax.Array, ...], ...]:
    """All gradient reductions of a step (inside ``shard_map``); returns the reduced gradients.

    ``grad_leaves`` are this device's accumulated local grads in flattened-tree order. The
    result is every leaf's fully reduced gradient (flattened-tree order, Megatron's
    ``main_grad``), or with the distributed optimizer this rank's shard of every bucket, per
    buffer (:func:`core.distributed.grad_sync.reduce_gradients`). With ``num_tokens`` (this
    rank's token count) the grads are divided by the global token count (see the module
    docstring).
    """
    reduced = reduce_local_grads(grad_leaves, infos, specs, ddp_config, state, per_token_loss=num_tokens is not None)
    return reduced if num_tokens is None else divide_by_global_tokens(reduced, num_tokens, state)


def reduce_local_grads(
    grad_leaves: Sequence[jax.Array],
    infos: Sequence[ParamInfo],
    specs: Sequence[BufferSpec],
    ddp_config: DistributedDataParallelConfig,
    state: ParallelState,
    *,
    per_token_loss: bool = False,
) -> list[jax.Array] | tuple[tuple[jax.Array, ...], ...]:
    """The model-parallel sums, then the data-parallel collective of every bucket, of one set of
    local grads: a step's accumulated grads, or with Megatron-FSDP ``optim_grads`` one
    microbatch's (every reduction is a sum, so reducing each microbatch and adding the results
    equals reducing their sum). ``per_token_loss``: no ``1/dp`` factor (the division by the
    global token count follows, :func:`divide_by_global_tokens`)."""
    leaves = allreduce_model_parallel_grads(grad_leaves, infos, state)
    return reduce_gradients(leaves, specs, ddp_config, state, per_token_loss=per_token_loss)


def divide_by_global_tokens(reduced: Any, num_tokens: jax.Array, state: ParallelState) -> Any:
    """Reduced grads divided by the global token count (``num_tokens``: this rank's count, summed
    over data (+context) parallelism here): the per-token loss normalisation."""
    total = lax.psum(jnp.asarray(num_tokens, jnp.float32), state.data_parallel_with_context_axis_name)
    scale = 1.0 / jnp.maximum(total, 1.0)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), reduced)


def nonfinite_flags(grad_leaves: Sequence[jax.Array]) -> jax.Array:
    """One bool per leaf: whether this device's gradient has a NaN or Inf (before reduction)."""
    return jnp.stack([~jnp.all(jnp.isfinite(g)) for g in grad_leaves]) if grad_leaves else jnp.zeros(0, bool)
