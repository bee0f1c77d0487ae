"""GPT building blocks as flax linen modules, run inside ``shard_map`` on local shards.

Activations are ``[s, b, h]`` (Megatron's layout), ``[s/tp, b, h]`` under sequence parallelism.
Every parameter is initialised tensor-parallel-invariantly (the tp=1 weight split k ways) and
declares its split (``core.param_metadata``), so the model is the same whatever the layout.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from core.fusions import FusedLayerNorm
from core.models.gpt.causal_attention import causal_attention, preferred_layout
from core.models.gpt.gpt_config import GPTConfig
from core.param_metadata import with_parallel_metadata
from core.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    tensor_parallel_init,
    vocab_parallel_cross_entropy,
)
from core.tensor_parallel.fast_vjp import linear
from core.tensor_parallel.layers import default_init_method
from core.tensor_parallel.utils import divide


def _normal(std: float):
    return lambda key, shape, dtype=jnp.float32: jax.random.normal(key, shape, dtype) * std


def layer_norm(config: GPTConfig, name: str) -> FusedLayerNorm:
    """A LayerNorm whose params are tagged sequence-parallel when the activations are shards."""
    meta = lambda init: with_parallel_metadata(init, (None,), sequence_parallel=config.sequence_parallel)
    return FusedLayerNorm(epsilon=config.layernorm_epsilon, scale_init=meta(nn.initializers.ones),
                          bias_init=meta(nn.initializers.zeros), name=name)


def apply_rotary(x: jax.Array, base: float, layout: str = "bnsd") -> jax.Array:
    """Rotary position embedding on ``[b, heads, s, d]`` (``layout="bnsd"``) or ``[b, s, heads,
    d]`` (``"bsnd"``): positions 0..s-1, rotate-half form."""
    seq_axis = layout.index("s")
    s, d = x.shape[seq_axis], x.shape[-1]
    inv_freq = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    if seq_axis == 1:  # [s, d] -> [s, 1, d], broadcast over the heads that follow the sequence
        angles = angles[:, None, :]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


# Where split_qkv sends [s, b, heads, 3, d] for each layout, and the way back.
_SPLIT = {"bnsd": (3, 1, 2, 0, 4), "bsnd": (3, 1, 0, 2, 4)}
_UNSPLIT = {"bnsd": (2, 0, 1, 3), "bsnd": (1, 0, 2, 3)}


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def split_qkv(qkv: jax.Array, layout: str = "bnsd") -> tuple[jax.Array, jax.Array, jax.Array]:
    """``[s, b, heads, 3, d]`` fused projections -> q, k, v in attention's ``layout``:
    ``[b, heads, s, d]`` (``"bnsd"``, batch dims leading for the CPU paths' batched matmuls) or
    ``[b, s, heads, d]`` (``"bsnd"``, cuDNN's).

    Autodiff of the unstacking would pad each gradient to the full ``[3, ...]`` shape and add
    the three before transposing back (measured ~21 ms per layer at 4096 tokens on one core);
    the hand-written VJP stacks and transposes once, like the forward (~3 ms).
    """
    q, k, v = jnp.transpose(qkv, _SPLIT[layout])
    return q, k, v


def _split_qkv_fwd(qkv: jax.Array, layout: str):
    return split_qkv(qkv, layout), None


def _split_qkv_bwd(layout: str, _, grads: tuple[jax.Array, jax.Array, jax.Array]):
    # Transposing each gradient and stacking on a minor axis: XLA's CPU backend emits the single
    # stack-then-transpose, whose result the linear layer flattens to 2-D, as a strided loop
    # (7.5 vs 1.5 ms for [16, 4, 256, 64] x 3 on one core).
    return (jnp.stack([jnp.transpose(g, _UNSPLIT[layout]) for g in grads], axis=3),)


split_qkv.defvjp(_split_qkv_fwd, _split_qkv_bwd)


class ParallelAttention(nn.Module):
    """Causal self-attention with heads split over tp (Megatron's ``SelfAttention``).

    The fused QKV weight is laid out head-major (``[heads, 3, head_dim]`` rows), so splitting its
    rows over tp gives each rank whole heads.
    """

    config: GPTConfig
    """Model hyper-parameters."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``[s(/tp), b, h] -> [s(/tp), b, h]`` (before the residual add)."""
        cfg = self.config
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        head_dim = h // heads
        qkv, _ = ColumnParallelLinear(h, 3 * h, sequence_parallel=cfg.sequence_parallel,
                                      init_method=_normal(cfg.init_method_std), name="linear_qkv")(x)
        s, b = qkv.shape[0], qkv.shape[1]
        local_heads = qkv.shape[-1] // (3 * head_dim)
        layout = preferred_layout()  # the backend's attention reads it without a transpose
        q, k, v = split_qkv(qkv.reshape(s, b, local_heads, 3, head_dim), layout)
        if cfg.position_embedding_type == "rope":
            q, k = apply_rotary(q, cfg.rotary_base, layout), apply_rotary(k, cfg.rotary_base, layout)
        ctx = causal_attention(q, k, v, layout)
        ctx = jnp.transpose(ctx, _UNSPLIT[layout]).reshape(s, b, local_heads * head_dim)
        # Megatron scales the output projection's init by 1/sqrt(2 * num_layers).
        out_std = cfg.init_method_std / (2.0 * cfg.num_layers) ** 0.5
        out, _ = RowParallelLinear(h, h, input_is_parallel=True, sequence_parallel=cfg.sequence_parallel,
                                   init_method=_normal(out_std), name="linear_proj")(ctx)
        return out


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: ``x + Attn(LN(x))``, then ``y + MLP(LN(y))``."""

    config: GPTConfig
    """Model hyper-parameters."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """One layer on ``[s(/tp), b, h]`` activations."""
        cfg = self.config
        x = x + ParallelAttention(cfg, name="self_attention")(layer_norm(cfg, "input_layernorm")(x))
        return ParallelMLP(cfg.hidden_size, cfg.ffn_size, sequence_parallel=cfg.sequence_parallel, name="mlp")(x)


class GPTEmbedding(nn.Module):
    """Word embedding (vocabulary split over tp) plus learned absolute positions.

    Returns ``[s, b, h]``, or this rank's ``[s/tp, b, h]`` shard under sequence parallelism.
    """

    config: GPTConfig
    """Model hyper-parameters."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Embed ``[b, s]`` token ids."""
        cfg = self.config
        sp = cfg.sequence_parallel
        x = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, reduce_scatter_embeddings=sp,
                                   init_method=_normal(cfg.init_method_std), shared_embedding=True,
                                   name="word_embeddings")(tokens)
        if not sp:
            x = jnp.swapaxes(x, 0, 1)  # [b, s, h] -> [s, b, h]
        if cfg.position_embedding_type == "learned_absolute":
            table = self.param("position_embeddings", with_parallel_metadata(
                _normal(cfg.init_method_std), (None, None), sequence_parallel=sp), (cfg.seq_length, cfg.hidden_size))
            s_local = x.shape[0]
            start = lax.axis_index("tp") * s_local if sp else 0
            x = x + lax.dynamic_slice_in_dim(table, start, s_local, axis=0)[:, None, :]
        return x


class GPTOutputHead(nn.Module):
    """Final LayerNorm and, when untied, the output layer's own ``[V/tp, h]`` weight."""

    config: GPTConfig
    """Model hyper-parameters."""

    @nn.compact
    def __call__(self, x: jax.Array, word_embeddings: jax.Array | None) -> jax.Array:
        """Vocabulary-split logits ``[s, b, V/tp]`` from ``[s(/tp), b, h]`` activations."""
        cfg = self.config
        x = layer_norm(cfg, "final_layernorm")(x)
        weight = word_embeddings
        if weight is None:
            local = divide(cfg.vocab_size, lax.axis_size("tp"))
            weight = self.param("output_layer", with_parallel_metadata(
                tensor_parallel_init(default_init_method, 0), ("tp", None)), (local, cfg.hidden_size))
        if cfg.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, True)
        else:
            x = copy_to_tensor_model_parallel_region(x)
        return linear(x, weight.astype(x.dtype))


def language_model_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean next-token cross entropy of vocabulary-split ``[s, b, V/tp]`` logits and ``[b, s]`` labels."""
    return jnp.mean(vocab_parallel_cross_entropy(logits, jnp.swapaxes(labels, 0, 1)))
