"""The transformer layer (Megatron's ``TransformerLayer``): pre-norm self-attention and MLP
(or MoE) blocks with residual adds, on ``[s, b, h]`` activations inside ``shard_map``.

Activations are ``[s, b, h]`` (Megatron's layout), ``[s/tp, b, h]`` under sequence parallelism.
Every parameter is initialised tensor-parallel-invariantly (the tp=1 weight split k ways) and
declares its split (``core.param_metadata``), so the layer is the same whatever the layout. The
microbatch's options and the layer's global index arrive in a
:class:`~core.transformer.layer_context.LayerContext`.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax

from core.transformer.attention import ParallelAttention
from core.transformer.layer_context import DROPOUT_ATTENTION_OUTPUT, DROPOUT_MLP_OUTPUT, LayerContext, hidden_dropout
from core.transformer.mlp import ParallelMLP
from core.transformer.moe import MoEBlock
from core.transformer.norms import build_norm
from core.transformer.transformer_config import TransformerConfig
from core.transformer.utils import init_method_normal, output_init_std


def layer_norm(config: TransformerConfig, name: str) -> nn.Module:
    """The configured norm (``config.normalization``: LayerNorm or RMSNorm, epsilon
    ``layernorm_epsilon``), params tagged sequence-parallel when the activations are shards."""
    return build_norm(config.normalization, config.layernorm_epsilon, config.sequence_parallel, name)


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: ``x + Dropout(Attn(Norm(x)))``, then ``y + Dropout(MLP(Norm(y)))``."""

    config: TransformerConfig
    """Model hyper-parameters."""
    moe: bool = False
    """A MoE layer: ``MoEBlock`` (``config.moe``) instead of ``ParallelMLP``; the call then returns
    ``(x, aux)`` with the MoE layer's aux dict (``core.transformer.moe.MoELayer``)."""

    @nn.compact
    def __call__(self, x: jax.Array, ctx: LayerContext | None = None) -> jax.Array | tuple[jax.Array, dict]:
        """One layer on ``[s(/tp), b, h]`` activations; ``ctx`` carries the microbatch's options
        and this layer's global index."""
        cfg = self.config
        sp = cfg.sequence_parallel
        attn = ParallelAttention(cfg, name="self_attention")(layer_norm(cfg, "input_layernorm")(x), ctx)
        x = x + hidden_dropout(attn, ctx, cfg.hidden_dropout, DROPOUT_ATTENTION_OUTPUT, sp, cfg.context_parallel_size)
        dropout_fn = None
        if cfg.hidden_dropout and ctx is not None and ctx.dropout_seed is not None:
            dropout_fn = partial(hidden_dropout, ctx=ctx, rate=cfg.hidden_dropout, site=DROPOUT_MLP_OUTPUT,
                                 sequence_parallel=sp, context_parallel_size=cfg.context_parallel_size)
        if self.moe:
            block = MoEBlock(cfg.moe, cfg.hidden_size, sequence_parallel=sp, normalization=cfg.normalization,
                             epsilon=cfg.layernorm_epsilon, init_method=init_method_normal(cfg.init_method_std),
                             output_layer_init_method=init_method_normal(output_init_std(cfg)), fp8=cfg.fp8_config,
                             name="mlp")
            return block(x, dropout_fn)
        mlp = ParallelMLP(cfg.hidden_size, cfg.ffn_size, sequence_parallel=sp, gated_linear_unit=cfg.swiglu,
                          bias=cfg.add_bias_linear, normalization=cfg.normalization, epsilon=cfg.layernorm_epsilon,
                          init_method=init_method_normal(cfg.init_method_std),
                          output_layer_init_method=init_method_normal(output_init_std(cfg)), fp8=cfg.fp8_config,
                          name="mlp")
        return mlp(x, dropout_fn)
