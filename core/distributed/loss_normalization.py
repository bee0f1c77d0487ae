"""The loss contract and its normalisation over microbatches, sequence shards and data parallelism.

A loss function returns Megatron's ``loss_func`` triple ``(loss, num_tokens, report)``: the loss
*summed* over this rank's tokens of the microbatch, their count, and a dict of logged values
(e.g. the MoE aux losses and expert loads; values identical over the ranks that split a sample).
How the sum becomes the objective is the training step's choice, as in Megatron:

* per-microbatch mean (Megatron's default): each microbatch's loss is divided by its token
  count, summed over the ranks that split the sequence (context parallelism), so the value is the
  whole sequence's mean on every rank (:func:`sequence_mean`), and the microbatches are averaged;
* per token (``calculate_per_token_loss``): summed losses, and the gradients are divided by the
  global token count (``finalize_model_grads(..., num_tokens)``).

Megatron also accepts a loss function that returns an already normalised mean, ``(loss, report)``
or a bare scalar; :func:`loss_terms` reads all three forms.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class LossTerms(NamedTuple):
    """A loss function's output in the contract's form."""

    loss: jax.Array
    """The loss summed over this rank's tokens (``num_tokens`` given), else an already normalised mean."""
    num_tokens: jax.Array | None
    """This rank's token count, None for a loss that is already a mean."""
    report: dict[str, Any]
    """Logged values (empty when the loss function gives none)."""


def loss_terms(output: Any) -> LossTerms:
    """``(loss, num_tokens, report)``, ``(mean_loss, report)`` or a scalar mean, as :class:`LossTerms`."""
    if isinstance(output, tuple):
        if len(output) == 3:
            loss, num_tokens, report = output
            return LossTerms(loss, jnp.asarray(num_tokens, jnp.float32), dict(report or {}))
        if len(output) == 2:
            return LossTerms(output[0], None, dict(output[1] or {}))
        raise TypeError(f"a loss function returns (loss, num_tokens, report), (loss, report) or a scalar loss; "
                        f"got a tuple of {len(output)}")
    return LossTerms(output, None, {})


def sequence_mean(loss_sum: jax.Array, num_tokens: jax.Array, sequence_axis: str | None = None) -> jax.Array:
    """The mean loss of a microbatch from this rank's ``loss_sum`` and ``num_tokens`` (denominator
    at least 1).

    ``sequence_axis``: the sequence is split over this mesh axis (``"cp"``). Numerator and
    denominator are then summed over it, so the value is the whole sequence's mean on every rank;
    the gradient is ``axis size`` times this rank's share of it (Megatron's ``loss * cp``),
    because the data-parallel reduction sums the sequence shards' gradients and divides by
    ``dp * cp``."""
    num_tokens = lax.stop_gradient(jnp.asarray(num_tokens, jnp.float32))
    if sequence_axis is None:
        return loss_sum / jnp.maximum(num_tokens, 1.0)
    denominator = jnp.maximum(lax.psum(num_tokens, sequence_axis), 1.0)
    # The psum only sees a stop_gradient'ed value, so no collective is transposed (its transpose
    # under shard_map without vma checks would multiply the cotangent by the axis size again).
    value = lax.psum(lax.stop_gradient(loss_sum), sequence_axis) / denominator
    share = lax.axis_size(sequence_axis) * loss_sum / denominator
    return value + (share - lax.stop_gradient(share))
