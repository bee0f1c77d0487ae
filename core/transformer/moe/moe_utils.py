"""Pure helpers of the MoE layer, Megatron's ``moe_utils.py``: top-k routing with a score function,
the scores of the load-balancing loss, the Switch and z losses, expert capacity and drop slots,
the sort that groups assignments by expert, and the aux-loss-free expert-bias update.

Shapes: ``T`` tokens of this rank, ``E`` experts, ``k`` = top-k. Routing decisions are kept in
the sparse ``[T, k]`` form (expert index and prob per selected slot), not Megatron's dense
``[T, E]`` map: grouping by expert is a sort of the ``T * k`` assignments.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax


def topk_routing_with_score_function(
    logits: jax.Array, topk: int, score_function: str = "softmax", use_pre_softmax: bool = False,
    expert_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Megatron's ``topk_routing_with_score_function`` on ``[T, E]`` logits, in the ``[T, k]`` form.

    * softmax, default: top-k of the logits, softmax over those k (each token's probs sum to 1);
    * softmax, ``use_pre_softmax``: softmax over all experts, then the top-k probabilities;
    * sigmoid: ``sigmoid(logits)``; with ``expert_bias`` the top-k is chosen on ``scores + bias``
      but the probs are the unbiased scores; for ``k > 1`` they are normalised to sum to 1.

    Score arithmetic in float32; returns ``(probs [T, k] in the logits' dtype, indices [T, k])``.
    """
    scores = logits.astype(jnp.float32)
    if score_function == "softmax":
        if use_pre_softmax:
            probs, indices = lax.top_k(jax.nn.softmax(scores, axis=-1), topk)
        else:
            top, indices = lax.top_k(scores, topk)
            probs = jax.nn.softmax(top, axis=-1)
    elif score_function == "sigmoid":
        scores = jax.nn.sigmoid(scores)
        if expert_bias is not None:
            _, indices = lax.top_k(scores + lax.stop_gradient(expert_bias).astype(jnp.float32), topk)
            probs = jnp.take_along_axis(scores, indices, axis=-1)
        else:
            probs, indices = lax.top_k(scores, topk)
        if topk > 1:
            probs = probs / (probs.sum(axis=-1, keepdims=True) + 1e-20)
    else:
        raise ValueError(f"invalid score function {score_function!r}")
    return probs.astype(logits.dtype), indices.astype(jnp.int32)


def compute_routing_scores_for_aux_loss(logits: jax.Array, topk: int,
                                        score_function: str) -> tuple[jax.Array, jax.Array]:
    """Megatron's scores and routing of the load-balancing loss: ``(scores [T, E] float32,
    indices [T, k])``. Scores are the softmax over all experts or the sigmoid normalised over all
    experts; the indices their top-k (no expert bias, no dropping)."""
    scores = logits.astype(jnp.float32)
    if score_function == "softmax":
        scores = jax.nn.softmax(scores, axis=-1)
    elif score_function == "sigmoid":
        scores = jax.nn.sigmoid(scores)
        scores = scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
    else:
        raise ValueError(f"invalid score function {score_function!r}")
    _, indices = lax.top_k(scores, topk)
    return scores, indices.astype(jnp.int32)


def tokens_per_expert(indices: jax.Array, num_experts: int, keep: jax.Array | None = None) -> jax.Array:
    """Assignments per expert ``[E]`` (float32) of ``[..., k]`` expert indices (those with ``keep``)."""
    weights = None if keep is None else keep.reshape(-1).astype(jnp.float32)
    return jnp.bincount(indices.reshape(-1), weights=weights, length=num_experts).astype(jnp.float32)


def switch_load_balancing_loss_func(probs: jax.Array, tokens_per_expert: jax.Array, total_num_tokens: int | jax.Array,
                                    topk: int, num_experts: int, moe_aux_loss_coeff: float) -> jax.Array:
    """Megatron's Switch loss ``coeff * E / (k * T^2) * sum_i (sum_x probs(x, i)) * tokens_per_expert_i``.

    ``probs`` ``[t, E]`` are this rank's (local) scores, ``tokens_per_expert`` and
    ``total_num_tokens`` counts over the whole group the loss is defined on; the sum of the
    ranks' values is the group's loss.
    """
    aggregated = probs.astype(jnp.float32).sum(axis=0)
    scale = num_experts * moe_aux_loss_coeff / (topk * jnp.square(jnp.asarray(total_num_tokens, jnp.float32)))
    return jnp.sum(aggregated * lax.stop_gradient(tokens_per_expert)) * scale


def z_loss_func(logits: jax.Array, z_loss_coeff: float, total_num_tokens: int | jax.Array) -> jax.Array:
    """ST-MoE router z-loss ``coeff * sum_x logsumexp(logits_x)^2 / T`` over this rank's ``[t, E]``
    logits, ``T`` the token count of the group (the ranks' values sum to the group's mean)."""
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return z_loss_coeff * jnp.sum(jnp.square(lse)) / jnp.asarray(total_num_tokens, jnp.float32)


def get_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Megatron's expert capacity ``ceil(num_tokens * topk / num_experts * capacity_factor)``."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def sort_by_expert(expert_ids: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stable sort of flat assignments by expert: ``(order, inverse, counts [num_groups])``.

    ``x[order]`` groups rows by expert (ties keep their order); ``y[inverse]`` undoes it. Ids equal
    to ``num_groups`` or above sort last and are not counted (padding)."""
    order = jnp.argsort(expert_ids, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    counts = jnp.bincount(expert_ids, length=num_groups + 1)[:num_groups].astype(jnp.int32)
    return order, inverse, counts


@jax.custom_vjp
def permute_rows(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """``x[order // k]`` for a permutation ``order`` of ``n = k * len(x)`` rows and its ``inverse``
    (:func:`sort_by_expert`'s), ``k = len(order) // len(x)``: every row of ``x`` ``k`` times, in
    ``order``. With ``k = 1`` a plain permutation.

    The backward gathers instead of scatter-adding: the cotangent's rows back in ``x``'s order
    (``g[inverse]``), each row's ``k`` copies summed in fp32. Autodiff of the gather would
    scatter-add the rows in the activations' dtype; a bf16 scatter-add is a slow atomic
    compare-and-swap loop on a GPU (``bench/results/2026-11-gpu.md``) and an element loop on the
    CPU.
    """
    return x[order // (order.shape[0] // x.shape[0])]


def _permute_rows_fwd(x: jax.Array, order: jax.Array, inverse: jax.Array):
    return permute_rows(x, order, inverse), (order, inverse, x.shape[0])


def _permute_rows_bwd(res, g: jax.Array):
    order, inverse, n = res
    k = order.shape[0] // n
    gx = g[inverse]
    if k > 1:
        gx = gx.reshape(n, k, -1).astype(jnp.float32).sum(axis=1).astype(g.dtype)
    return gx, None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def capacity_slots(indices: jax.Array, probs: jax.Array, num_experts: int, capacity: int,
                   drop_policy: str = "probs") -> tuple[jax.Array, jax.Array]:
    """Megatron's token dropping (``apply_router_token_dropping``) in the ``[T, k]`` form.

    Each expert keeps at most ``capacity`` of the assignments routed to it: those with the highest
    prob (``"probs"``; equal probs: the earlier token) or the earliest tokens (``"position"``).
    Returns ``(keep [T, k] bool, slot [T, k] int32)``: ``slot`` is the assignment's row in its
    expert's ``capacity`` buffer (meaningful where ``keep``).
    """
    n = indices.size
    e = indices.reshape(-1)
    token = jnp.arange(n, dtype=jnp.int32) // indices.shape[-1]
    if drop_policy == "probs":
        order = jnp.lexsort((token, -lax.stop_gradient(probs).reshape(-1).astype(jnp.float32), e))
    elif drop_policy == "position":
        order = jnp.argsort(e, stable=True)  # flat order is token-major
    else:
        raise ValueError(f"invalid drop policy {drop_policy!r}")
    counts = jnp.bincount(e, length=num_experts)
    starts = jnp.cumsum(counts) - counts
    position = jnp.arange(n, dtype=jnp.int32) - starts[e[order]]
    slot = jnp.zeros(n, jnp.int32).at[order].set(position.astype(jnp.int32)).reshape(indices.shape)
    return slot < capacity, slot


def get_updated_expert_bias(tokens_per_expert: jax.Array, expert_bias: jax.Array, expert_bias_update_rate: float,
                            axis_name: str | Sequence[str] | None = None) -> jax.Array:
    """Megatron's aux-loss-free bias step: ``bias + rate * sign(mean(tpe) - tpe)``.

    ``tokens_per_expert`` ``[..., E]`` is what the layer returned (this rank's counts, summed over
    micro-batches; leading dims, e.g. stacked layers, are updated independently); inside
    ``shard_map`` pass ``axis_name`` (Megatron: tensor x data x context parallel axes, e.g.
    ``("dp", "ep", "cp", "tp")``) to sum it over the ranks first. Pure: the trainer stores the
    result as the layer's ``moe_state`` ``expert_bias``.
    """
    tpe = tokens_per_expert.astype(jnp.float32)
    if axis_name:
        tpe = lax.psum(tpe, tuple([axis_name] if isinstance(axis_name, str) else axis_name))
    step = jnp.sign(tpe.mean(axis=-1, keepdims=True) - tpe) * expert_bias_update_rate
    return (expert_bias.astype(jnp.float32) + step).astype(expert_bias.dtype)


_AUX_LOSS_SCALE: list[float | None] = [1.0]


@contextlib.contextmanager
def moe_aux_loss_scale(scale: float | None) -> Iterator[None]:
    """Megatron's ``MoEAuxLossAutoScaler.set_loss_scale`` for the code traced inside: the
    cotangent the MoE aux losses get in the backward (:func:`attach_aux_loss`). The training step
    sets ``1 / num_microbatches`` (the LM loss's own scaling); None: the step cannot weigh them
    (a per-token loss), and a model with aux losses is refused where it attaches them."""
    previous = _AUX_LOSS_SCALE[0]
    _AUX_LOSS_SCALE[0] = scale
    try:
        yield
    finally:
        _AUX_LOSS_SCALE[0] = previous


def current_moe_aux_loss_scale() -> float:
    """The scale :func:`moe_aux_loss_scale` set (1.0 outside a training step)."""
    scale = _AUX_LOSS_SCALE[0]
    if scale is None:
        raise ValueError("MoE auxiliary losses need a per-microbatch mean loss: calculate_per_token_loss "
                         "(per-token normalisation) does not weigh them")
    return scale


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def attach_aux_loss(x: jax.Array, aux_loss: jax.Array, scale: float) -> jax.Array:
    """Identity on ``x`` whose backward also gives ``aux_loss`` the cotangent ``scale``: Megatron's
    ``MoEAuxLossAutoScaler``. The aux loss's gradient joins the backward wherever ``x``'s does (any
    pipeline stage), as if ``scale * aux_loss`` were added to the loss; ``scale`` is the LM loss's
    own scaling (``1 / num_microbatches``, :func:`current_moe_aux_loss_scale`)."""
    return x


def _attach_fwd(x, aux_loss, scale):
    return x, aux_loss


def _attach_bwd(scale, aux_loss, g):
    return g, jnp.full_like(aux_loss, scale)


attach_aux_loss.defvjp(_attach_fwd, _attach_bwd)
