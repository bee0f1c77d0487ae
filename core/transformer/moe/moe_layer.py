"""``MoELayer``: router -> token dispatch -> experts -> combine (+ shared expert), Megatron's MoE layer.

Runs inside ``shard_map`` on ``[s, b, h]`` activations (``[s/tp, b, h]`` under sequence
parallelism), every mesh axis of ``core.parallel_state`` bound. Like Megatron's ``MoELayer`` it is
the MLP's inner part: its input is the pre-MLP norm's output and its output goes to the dropout and
residual add outside. :class:`MoEBlock` wraps it as ``ParallelMLP`` is used in ``TransformerLayer``
(norm named ``layernorm``, then the layer, dropout, residual), so a transformer layer can swap one
for the other; it returns the aux dict as well.

The layer returns ``(output, aux)`` with ``aux["aux_loss"]`` and ``aux["z_loss"]`` (this rank's
shares, coefficients included: add them to the loss; see :mod:`core.transformer.moe.router` for the
token groups they pool) and ``aux["tokens_per_expert"]`` (``[E]`` this rank's assignments per expert
after dropping, for load logging and :func:`~core.transformer.moe.moe_utils.get_updated_expert_bias`).

Layouts: ``num_experts`` split over ``ep`` (a split of data parallelism: every ep rank holds other
tokens), expert tensor parallelism 1. With tp > 1 sequence parallelism is required (as in Megatron):
each tp rank routes its own sequence shard, and the router and expert weights, replicated over tp,
have their gradients summed over tp (``sequence_parallel`` metadata).

FP8 (``fp8``): the routed experts' GEMMs (:mod:`core.transformer.moe.experts`) and the shared
expert's fc1/fc2 run in FP8; the router's linear layer stays in high precision (Transformer
Engine's MoE keeps the router out of FP8: its logits decide the routing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from jax import lax

from core.fp8 import FP8Config
from core.parallel_state import EP_AXIS, TP_AXIS
from core.tensor_parallel.layers import default_init_method
from core.tensor_parallel.random import sequence_parallel_dropout
from core.transformer.moe.experts import GroupedMLP, SequentialMLP
from core.transformer.moe.grouped_gemm import default_window
from core.transformer.moe.moe_config import MoEConfig
from core.transformer.moe.router import TopKRouter
from core.transformer.moe.shared_experts import SharedExpertMLP
from core.transformer.moe.token_dispatcher import build_token_dispatcher
from core.transformer.norms import build_norm


class MoELayer(nn.Module):
    """Mixture of experts on ``[s(/tp), b, h]``; returns ``(output, aux)`` (module docstring)."""

    config: MoEConfig
    """The MoE options."""
    hidden_size: int
    """Model width ``h``."""
    sequence_parallel: bool = False
    """Input and output are this tp rank's ``[s/tp, b, h]`` sequence shard (needed for tp > 1)."""
    sequence_axes: tuple[str, ...] = (TP_AXIS, "cp")
    """Axes splitting the sequences, pooled in the router's losses (:class:`TopKRouter`)."""
    batch_axes: tuple[str, ...] = ()
    """Axes holding other sequences pooled in the losses, e.g. ``("dp", "ep")`` (:class:`TopKRouter`)."""
    init_method: Callable[..., jax.Array] = default_init_method
    """Router, expert ``weight1`` and shared ``fc1`` initializer (global shapes)."""
    output_layer_init_method: Callable[..., jax.Array] = default_init_method
    """Expert ``weight2`` and shared ``fc2`` initializer (global shapes)."""
    params_dtype: Any = None
    """Parameter dtype (None: float32)."""
    fp8: FP8Config | None = None
    """FP8 GEMMs in the experts and the shared expert (module docstring; None: high precision)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``(output [s(/tp), b, h], {"aux_loss", "z_loss", "tokens_per_expert"})``."""
        cfg = self.config
        ep, tp = lax.axis_size(EP_AXIS), lax.axis_size(TP_AXIS)
        cfg.validate(ep, tp, self.sequence_parallel)
        sp = self.sequence_parallel and tp > 1
        dtype = {} if self.params_dtype is None else {"params_dtype": self.params_dtype}
        s, b, h = x.shape
        routing = TopKRouter(cfg, sequence_parallel=sp, sequence_axes=self.sequence_axes, batch_axes=self.batch_axes,
                             init_method=self.init_method, name="router", **dtype)(x)
        dispatcher = build_token_dispatcher(cfg.moe_token_dispatcher_type, cfg.num_experts, ep, EP_AXIS)
        rows, group_sizes, ctx = dispatcher.dispatch(x.reshape(s * b, h), routing)
        e_local = cfg.num_experts // ep
        grouped = {}
        if cfg.moe_grouped_gemm:  # every expert holds ep x capacity rows, or on average T x k / E_local
            grouped["window"] = (ep * routing.capacity if routing.capacity is not None
                                 else default_window(s * b * cfg.moe_router_topk, e_local))
            grouped["implementation"] = cfg.moe_grouped_gemm_implementation
        experts = (GroupedMLP if cfg.moe_grouped_gemm else SequentialMLP)(
            e_local, self.hidden_size, cfg.moe_ffn_hidden_size, gated_linear_unit=cfg.swiglu,
            bias=cfg.add_bias_linear, sequence_parallel=sp, init_method=self.init_method,
            output_layer_init_method=self.output_layer_init_method, fp8=self.fp8, name="experts", **grouped, **dtype)
        y = dispatcher.combine(experts(rows, group_sizes), ctx).reshape(s, b, h)
        if cfg.moe_shared_expert_intermediate_size is not None:
            y = y + SharedExpertMLP(self.hidden_size, cfg.moe_shared_expert_intermediate_size,
                                    gated_linear_unit=cfg.swiglu, bias=cfg.add_bias_linear,
                                    sequence_parallel=self.sequence_parallel, init_method=self.init_method,
                                    output_layer_init_method=self.output_layer_init_method, fp8=self.fp8,
                                    name="shared_experts")(x).astype(y.dtype)
        aux = {"aux_loss": routing.aux_loss, "z_loss": routing.z_loss, "tokens_per_expert": routing.tokens_per_expert}
        return y, aux


class MoEBlock(nn.Module):
    """``x + Dropout(MoELayer(Norm(x)))``: the MoE counterpart of ``ParallelMLP``'s block, same call."""

    config: MoEConfig
    """The MoE options."""
    hidden_size: int
    """Model width."""
    sequence_parallel: bool = False
    """Sequence parallelism (``[s/tp, b, h]`` shards in and out)."""
    hidden_dropout: float = 0.0
    """Dropout rate on the MoE output before the residual add (needs a ``"dropout"`` rng)."""
    deterministic: bool = True
    """Disable dropout."""
    normalization: str = "LayerNorm"
    """The pre-norm: ``"LayerNorm"`` or ``"RMSNorm"``."""
    epsilon: float = 1e-6
    """The pre-norm's epsilon."""
    sequence_axes: tuple[str, ...] = (TP_AXIS, "cp")
    """Passed to :class:`MoELayer`."""
    batch_axes: tuple[str, ...] = ()
    """Passed to :class:`MoELayer`."""
    init_method: Callable[..., jax.Array] = default_init_method
    """Passed to :class:`MoELayer`."""
    output_layer_init_method: Callable[..., jax.Array] = default_init_method
    """Passed to :class:`MoELayer`."""
    fp8: FP8Config | None = None
    """Passed to :class:`MoELayer`."""

    @nn.compact
    def __call__(self, x: jax.Array, dropout_fn: Callable[[jax.Array], jax.Array] | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``(x + Dropout(MoE(Norm(x))), aux)``; ``dropout_fn`` as in ``ParallelMLP``."""
        sp = self.sequence_parallel
        h = build_norm(self.normalization, self.epsilon, sp, "layernorm")(x)
        h, aux = MoELayer(self.config, self.hidden_size, sequence_parallel=sp, sequence_axes=self.sequence_axes,
                          batch_axes=self.batch_axes, init_method=self.init_method,
                          output_layer_init_method=self.output_layer_init_method, fp8=self.fp8, name="moe")(h)
        if dropout_fn is not None:
            h = dropout_fn(h)
        elif self.hidden_dropout and not self.deterministic:
            h = sequence_parallel_dropout(self.make_rng("dropout"), h, self.hidden_dropout, sp, TP_AXIS)
        return x + h, aux
