"""``TopKRouter``: Megatron-core's MoE router (linear gate, top-k, load-balancing and z losses).

Runs inside ``shard_map`` on this rank's ``[s, b, h]`` tokens (``[s/tp, b, h]`` under sequence
parallelism: each tp rank routes its own sequence shard). The gate weight ``[E, h]`` is a dense
parameter replicated over every axis; under sequence parallelism it is tagged
``sequence_parallel`` so its gradient is summed over tp (each tp rank saw different tokens).

Losses are returned as values, not injected into the backward as Megatron's
``MoEAuxLossAutoScaler`` does: the caller adds them to its loss (and logs them separately).
Their level is set by the axes the micro-batch's tokens are split over:

* ``sequence_axes`` (default ``("tp", "cp")``, Megatron's tensor x context parallel group): the
  ranks that hold pieces of the same sequences;
* ``batch_axes`` (default none): ranks that hold other sequences of the batch whose statistics
  should be pooled (e.g. ``("dp", "ep")`` for a loss over the whole data-parallel batch, the
  layout-invariant choice; Megatron's ``aux_loss`` is per data-parallel rank).

Token counts are summed over both; each rank's probabilities stay local. Each returned loss is
this rank's share: summed over those axes it is the loss of the pooled tokens (a sum that the
sequence-parallel gradient reduction over tp performs for the gradient).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from core.parallel_state import EP_AXIS, TP_AXIS
from core.param_metadata import with_parallel_metadata
from core.tensor_parallel.layers import default_init_method
from core.transformer.moe import moe_utils
from core.transformer.moe.moe_config import MoEConfig

MOE_STATE = "moe_state"
"""Flax collection of the MoE layers' non-trainable state (the expert bias)."""


@flax.struct.dataclass
class RouterOutput:
    """The router's decisions for this rank's ``T`` tokens and its losses."""

    probs: jax.Array
    """``[T, k]`` routing prob of each selected expert (zero where dropped)."""
    indices: jax.Array
    """``[T, k]`` int32 selected experts (global ids)."""
    keep: jax.Array | None
    """``[T, k]`` bool: the assignment survived capacity dropping (None: dropless)."""
    slots: jax.Array | None
    """``[T, k]`` int32 row of the assignment in its expert's capacity buffer (None: dropless)."""
    capacity: int | None = flax.struct.field(pytree_node=False, default=None)
    """Rows per expert and rank in the capacity path (None: dropless)."""
    aux_loss: jax.Array | None = None
    """This rank's share of the load-balancing loss (coefficient included; 0 when off)."""
    z_loss: jax.Array | None = None
    """This rank's share of the z-loss (coefficient included; 0 when off)."""
    tokens_per_expert: jax.Array | None = None
    """``[E]`` float32 assignments per expert on this rank after dropping (Megatron's
    ``local_tokens_per_expert``: with padding to capacity, the capacity for every expert)."""


def _axes_size(axes: tuple[str, ...]) -> int:
    return lax.axis_size(axes) if axes else 1


def _psum(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return lax.psum(x, axes) if axes else x


class TopKRouter(nn.Module):
    """Megatron's ``TopKRouter``: ``logits = x W^T``, top-k routing, capacity, aux and z losses."""

    config: MoEConfig
    """The MoE options."""
    sequence_parallel: bool = False
    """Input is this tp rank's sequence shard: tag the weight ``sequence_parallel``."""
    sequence_axes: tuple[str, ...] = ("tp", "cp")
    """Mesh axes that split the sequences (see the module docstring)."""
    batch_axes: tuple[str, ...] = ()
    """Mesh axes whose ranks hold other sequences pooled into the losses (module docstring)."""
    init_method: Callable[..., jax.Array] = default_init_method
    """Gate weight initializer (shape ``[E, h]``)."""
    params_dtype: Any = jnp.float32
    """Gate weight dtype."""

    @nn.compact
    def __call__(self, x: jax.Array) -> RouterOutput:
        """Route ``[s, b, h]`` tokens (flattened ``s``-major to ``T = s * b``)."""
        cfg = self.config
        s, b, h = x.shape
        num_experts, k = cfg.num_experts, cfg.moe_router_topk
        weight = self.param("weight", with_parallel_metadata(self.init_method, (None, None),
                                                             sequence_parallel=self.sequence_parallel),
                            (num_experts, h), self.params_dtype)
        tokens = x.reshape(s * b, h)
        if cfg.moe_router_dtype == "fp32":
            tokens, weight = tokens.astype(jnp.float32), weight.astype(jnp.float32)
        else:
            weight = weight.astype(tokens.dtype)
        logits = tokens @ weight.T  # [T, E]
        if cfg.moe_router_force_load_balancing:
            logits = self._random_logits(logits)

        bias = None
        if cfg.moe_router_enable_expert_bias:
            bias = self.variable(MOE_STATE, "expert_bias", lambda: jnp.zeros((num_experts,), jnp.float32)).value
        probs, indices = moe_utils.topk_routing_with_score_function(
            logits, k, cfg.moe_router_score_function, cfg.moe_router_pre_softmax, bias)

        keep = slots = capacity = None
        if cfg.capacity_dropping:
            capacity = min(moe_utils.get_capacity(s * b, num_experts, k, cfg.moe_expert_capacity_factor), s * b)
            keep, slots = moe_utils.capacity_slots(indices, probs, num_experts, capacity, cfg.moe_token_drop_policy)
            probs = jnp.where(keep, probs, 0).astype(probs.dtype)
        if cfg.moe_pad_expert_input_to_capacity:
            local_counts = jnp.full((num_experts,), capacity, jnp.float32)
        else:
            local_counts = moe_utils.tokens_per_expert(indices, num_experts, keep)

        aux = self._load_balancing_loss(logits, s, b)
        z = jnp.zeros((), jnp.float32)
        if cfg.moe_z_loss_coeff is not None:
            total = s * b * _axes_size(self.sequence_axes + self.batch_axes)
            z = moe_utils.z_loss_func(logits, cfg.moe_z_loss_coeff, total)
        return RouterOutput(probs, indices, keep, slots, capacity, aux, z, local_counts)

    def _random_logits(self, logits: jax.Array) -> jax.Array:
        """Random normal logits of this rank (a fixed seed folded with its index on the ep, tp and
        token axes), carrying ``logits``' gradient: Megatron's ``RandomSTE`` for
        ``--moe-router-force-load-balancing``."""
        key = jax.random.key(42)
        for axis in dict.fromkeys((EP_AXIS, TP_AXIS, *self.sequence_axes, *self.batch_axes)):
            key = jax.random.fold_in(key, lax.axis_index(axis))
        noise = jax.random.normal(key, logits.shape, jnp.float32).astype(logits.dtype)
        return noise + (logits - lax.stop_gradient(logits))

    def _load_balancing_loss(self, logits: jax.Array, s: int, b: int) -> jax.Array:
        cfg = self.config
        kind, coeff = cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff
        if kind == "none" or coeff == 0:
            return jnp.zeros((), jnp.float32)
        num_experts, k = cfg.num_experts, cfg.moe_router_topk
        scores, indices = moe_utils.compute_routing_scores_for_aux_loss(logits, k, cfg.moe_router_score_function)
        if kind == "aux_loss":
            axes = self.sequence_axes + self.batch_axes
            counts = _psum(moe_utils.tokens_per_expert(indices, num_experts), axes)
            return moe_utils.switch_load_balancing_loss_func(scores, counts, s * b * _axes_size(axes), k,
                                                             num_experts, coeff)
        # seq_aux_loss: the Switch loss of each sequence (column b of [s, b]), averaged over sequences.
        seq_ids = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[None, :, None], (s, b, k)).reshape(-1)
        counts = jnp.bincount(seq_ids * num_experts + indices.reshape(-1), length=b * num_experts)
        counts = _psum(counts.astype(jnp.float32), self.sequence_axes)
        seq_len = s * _axes_size(self.sequence_axes)
        loss = moe_utils.switch_load_balancing_loss_func(scores.reshape(s, b * num_experts), counts, seq_len, k,
                                                         num_experts, coeff)
        return loss / (b * _axes_size(self.batch_axes))
