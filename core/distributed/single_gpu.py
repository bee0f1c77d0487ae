"""Train state, batch and gradient accumulation with the xlstm_jax / JAX-scaling-tutorial API.

Same names and semantics as the tutorial's ``single_gpu.py`` (``xlstm_jax.distributed.single_gpu``):

* :class:`TrainState` is flax's ``TrainState`` carrying a PRNG key ``rng``;
* :class:`Batch` holds ``inputs`` and ``labels``;
* :func:`accumulate_gradients` splits a batch into ``num_minibatches`` equal minibatches along
  dimension 0 (``minibatch_size = batch_size // num_minibatches``, rows past the last full
  minibatch are not used), calls ``loss_fn(params, apply_fn, minibatch, rng)`` on each, and
  returns the gradients **averaged** over the minibatches and the metrics **summed** over them.

Conventions (the tutorial's):

* ``loss_fn`` returns ``(loss, metrics)``; ``metrics`` maps a name to a tuple of arrays, by
  convention ``(sum, count)`` so that summing over minibatches (and ``psum`` over devices)
  then dividing gives the mean;
* the key of minibatch ``i`` is ``jax.random.split(rng, num_minibatches)[i]``: every
  minibatch draws different dropout masks, and the loop and the scan variants use the same
  keys, so they compute the same result;
* with a ``loss_fn`` that returns the mean over its minibatch, the averaged gradient equals
  the gradient of the mean loss over the whole batch.

Inside ``jax.shard_map`` these run on each device's local batch; synchronise the gradients
afterwards (e.g. :func:`core.distributed.data_parallel.sync_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from flax.training import train_state

PyTree = Any
"""Any pytree (parameters, gradients)."""
Metrics = dict[str, tuple[jax.Array, ...]]
"""Metric name -> tuple of arrays, by convention ``(sum, count)``."""
LossFn = Callable[[PyTree, Callable[..., Any], "Batch", jax.Array], tuple[jax.Array, Metrics]]
"""``loss_fn(params, apply_fn, minibatch, rng) -> (loss, metrics)``."""


class TrainState(train_state.TrainState):
    """flax's ``TrainState`` (step, apply_fn, params, tx, opt_state) plus a PRNG key.

    Create it with ``TrainState.create(apply_fn=..., params=..., tx=..., rng=key)``; a train
    step typically splits ``state.rng`` and passes the new key on with
    ``state.apply_gradients(grads=grads, rng=new_rng)``.
    """

    rng: jax.Array
    """The PRNG key carried from step to step (e.g. for dropout)."""


@struct.dataclass
class Batch:
    """A training batch: model inputs and labels, batch dimension first."""

    inputs: jax.Array
    """Model inputs, shape ``[batch, ...]``."""
    labels: jax.Array
    """Targets, shape ``[batch, ...]``."""


def _minibatch_keys(rng: jax.Array, num_minibatches: int) -> jax.Array:
    """One key per minibatch (the tutorial's ``jax.random.split(rng, num_minibatches)``)."""
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches must be at least 1, got {num_minibatches}")
    return jax.random.split(rng, num_minibatches)


def _minibatch_grads(state: TrainState, batch: Batch, rngs: jax.Array, loss_fn: LossFn, minibatch_size: int,
                     minibatch_idx: jax.Array | int) -> tuple[PyTree, Metrics]:
    """Gradients and metrics of minibatch ``minibatch_idx`` (dynamic slice: the index may be traced)."""
    minibatch = jax.tree.map(
        lambda x: jax.lax.dynamic_slice_in_dim(x, minibatch_idx * minibatch_size, minibatch_size, axis=0), batch)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, metrics), grads = grad_fn(state.params, state.apply_fn, minibatch, rngs[minibatch_idx])
    return grads, metrics


def accumulate_gradients_loop(
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    num_minibatches: int,
    loss_fn: LossFn,
) -> tuple[PyTree, Metrics]:
    """Gradients and metrics of ``batch`` by gradient accumulation over a Python loop (unrolled).

    Args:
        state: Current training state (``params`` and ``apply_fn`` are used).
        batch: Full batch; every leaf is split along dimension 0.
        rng: Key; minibatch ``i`` gets ``jax.random.split(rng, num_minibatches)[i]``.
        num_minibatches: Number of minibatches, i.e. gradient-accumulation steps.
        loss_fn: ``loss_fn(params, apply_fn, minibatch, rng) -> (loss, metrics)``.

    Returns:
        ``(grads, metrics)``: gradients averaged over the minibatches, metrics summed.
    """
    minibatch_size = batch.inputs.shape[0] // num_minibatches
    rngs = _minibatch_keys(rng, num_minibatches)
    grads = None
    metrics = None
    for minibatch_idx in range(num_minibatches):
        with jax.named_scope(f"minibatch_{minibatch_idx}"):
            step_grads, step_metrics = _minibatch_grads(state, batch, rngs, loss_fn, minibatch_size, minibatch_idx)
            if grads is None:
                grads, metrics = step_grads, step_metrics
            else:
                grads = jax.tree.map(jnp.add, grads, step_grads)
                metrics = jax.tree.map(jnp.add, metrics, step_metrics)
    grads = jax.tree.map(lambda g: g / num_minibatches, grads)
    return grads, metrics


def accumulate_gradients_scan(
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    num_minibatches: int,
    loss_fn: LossFn,
) -> tuple[PyTree, Metrics]:
    """Gradients and metrics of ``batch`` by gradient accumulation in a ``jax.lax.scan``.

    Same result as :func:`accumulate_gradients_loop` (same minibatches, same keys), compiled
    once instead of ``num_minibatches`` times.

    Args:
        state: Current training state (``params`` and ``apply_fn`` are used).
        batch: Full batch; every leaf is split along dimension 0.
        rng: Key; minibatch ``i`` gets ``jax.random.split(rng, num_minibatches)[i]``.
        num_minibatches: Number of minibatches, i.e. gradient-accumulation steps.
        loss_fn: ``loss_fn(params, apply_fn, minibatch, rng) -> (loss, metrics)``.

    Returns:
        ``(grads, metrics)``: gradients averaged over the minibatches, metrics summed.
    """
    minibatch_size = batch.inputs.shape[0] // num_minibatches
    rngs = _minibatch_keys(rng, num_minibatches)

    def _minibatch_step(minibatch_idx: jax.Array | int) -> tuple[PyTree, Metrics]:
        return _minibatch_grads(state, batch, rngs, loss_fn, minibatch_size, minibatch_idx)

    def _scan_step(carry: tuple[PyTree, Metrics], minibatch_idx: jax.Array) -> tuple[tuple[PyTree, Metrics], None]:
        step_grads, step_metrics = _minibatch_step(minibatch_idx)
        return jax.tree.map(jnp.add, carry, (step_grads, step_metrics)), None

    grads_shapes, metrics_shapes = jax.eval_shape(_minibatch_step, 0)
    grads = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), grads_shapes)
    metrics = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), metrics_shapes)
    (grads, metrics), _ = jax.lax.scan(
        _scan_step, init=(grads, metrics), xs=jnp.arange(num_minibatches), length=num_minibatches)
    grads = jax.tree.map(lambda g: g / num_minibatches, grads)
    return grads, metrics


def accumulate_gradients(
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    num_minibatches: int,
    loss_fn: LossFn,
    use_scan: bool = False,
) -> tuple[PyTree, Metrics]:
    """Gradients (averaged) and metrics (summed) of ``batch`` over ``num_minibatches`` minibatches.

    Dispatches to :func:`accumulate_gradients_scan` when ``use_scan`` is set, else to
    :func:`accumulate_gradients_loop`; both give the same result (see the module docstring
    for the minibatch split, the per-minibatch keys and the ``loss_fn`` contract).
    """
    fn = accumulate_gradients_scan if use_scan else accumulate_gradients_loop
    return fn(state=state, batch=batch, rng=rng, num_minibatches=num_minibatches, loss_fn=loss_fn)


__all__ = [
    "Batch", "LossFn", "Metrics", "PyTree", "TrainState", "accumulate_gradients", "accumulate_gradients_loop",
    "accumulate_gradients_scan",
]
