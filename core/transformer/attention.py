"""Self-attention with heads split over tensor parallelism (Megatron's ``SelfAttention``).

The fused QKV projection is split into q, k and v in the layout the backend's core attention
reads (``core.transformer.dot_product_attention``), rotary is applied to q and k under
``position_embedding_type="rope"``, and the core attention runs on this rank's heads: causal
attention on the whole local sequence, or context-parallel attention over ``"cp"``
(``core.context_parallel``) when the sequence is split. Attention-probability dropout draws
its masks per global head and (query, key) index, so they do not depend on the layout.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from core.context_parallel import attention_dropout_mask, context_parallel_attention, kv_rotation_for
from core.parallel_state import CP_AXIS, PP_AXIS, TP_AXIS
from core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from core.transformer.dot_product_attention import causal_attention, preferred_layout
from core.transformer.layer_context import DROPOUT_ATTENTION_PROBS, LayerContext, dropout_keys
from core.transformer.norms import build_norm
from core.transformer.rotary_pos_embedding import apply_rotary, inverse_frequencies, llama3_scaled_frequencies
from core.transformer.transformer_config import TransformerConfig
from core.transformer.utils import init_method_normal, output_init_std

# Where split_qkv sends [s, b, heads, 3, d] for each layout, and the way back.
_SPLIT = {"bnsd": (3, 1, 2, 0, 4), "bsnd": (3, 1, 0, 2, 4)}
_UNSPLIT = {"bnsd": (2, 0, 1, 3), "bsnd": (1, 0, 2, 3)}


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def split_qkv(qkv: jax.Array, layout: str = "bnsd") -> tuple[jax.Array, jax.Array, jax.Array]:
    """``[s, b, heads, 3, d]`` fused projections -> q, k, v in attention's ``layout``:
    ``[b, heads, s, d]`` (``"bnsd"``, batch dims leading for the CPU paths' batched matmuls) or
    ``[b, s, heads, d]`` (``"bsnd"``, cuDNN's).

    Autodiff of the unstacking would pad each gradient to the full ``[3, ...]`` shape and add
    the three before transposing back, several full-size passes per layer; the hand-written VJP
    stacks and transposes once, like the forward.
    """
    q, k, v = jnp.transpose(qkv, _SPLIT[layout])
    return q, k, v


def _split_qkv_fwd(qkv: jax.Array, layout: str):
    return split_qkv(qkv, layout), None


def _split_qkv_bwd(layout: str, _, grads: tuple[jax.Array, jax.Array, jax.Array]):
    # Transposing each gradient and stacking on a minor axis: XLA's CPU backend emits the single
    # stack-then-transpose, whose result the linear layer flattens to 2-D, as a strided loop
    # several times slower.
    return (jnp.stack([jnp.transpose(g, _UNSPLIT[layout]) for g in grads], axis=3),)


split_qkv.defvjp(_split_qkv_fwd, _split_qkv_bwd)

# [s, b, heads, d] to each layout.
_FROM_SBND = {"bnsd": (1, 2, 0, 3), "bsnd": (1, 0, 2, 3)}


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def split_qkv_grouped(qkv: jax.Array, layout: str = "bnsd") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Grouped-query ``[s, b, groups, r + 2, d]`` projections (each group: its ``r`` query heads,
    then its key, then its value; Megatron's layout) -> q ``groups * r`` heads, k and v
    ``groups`` heads, in attention's ``layout`` (see :func:`split_qkv`).

    Like :func:`split_qkv`, the VJP concatenates the three gradients once instead of letting
    autodiff pad each slice's gradient to the full shape and add them.
    """
    s, b, g, r2, d = qkv.shape
    r = r2 - 2
    q = qkv[:, :, :, :r].reshape(s, b, g * r, d)
    k, v = qkv[:, :, :, r], qkv[:, :, :, r + 1]
    return tuple(jnp.transpose(x, _FROM_SBND[layout]) for x in (q, k, v))


def _split_qkv_grouped_fwd(qkv: jax.Array, layout: str):
    return split_qkv_grouped(qkv, layout), None


def _split_qkv_grouped_bwd(layout: str, _, grads: tuple[jax.Array, jax.Array, jax.Array]):
    dq, dk, dv = (jnp.transpose(g, _UNSPLIT[layout]) for g in grads)  # [s, b, heads, d]
    s, b, g, d = dk.shape
    dq = dq.reshape(s, b, g, dq.shape[2] // g, d)
    return (jnp.concatenate([dq, dk[:, :, :, None], dv[:, :, :, None]], axis=3),)


split_qkv_grouped.defvjp(_split_qkv_grouped_fwd, _split_qkv_grouped_bwd)


def attention_dropout_head_keys(ctx: LayerContext, local_heads: int) -> jax.Array:
    """``[b, local_heads]`` keys of the attention-probability dropout: the sample's key folded with
    the global head index (this tp rank's heads are ``rank * local_heads ...``)."""
    keys = dropout_keys(ctx.dropout_seed, ctx.layer_index, DROPOUT_ATTENTION_PROBS)
    heads = lax.axis_index(TP_AXIS) * local_heads + jnp.arange(local_heads)
    return jax.vmap(lambda k: jax.vmap(lambda head: jax.random.fold_in(k, head))(heads))(keys)


def attention_dropout_keep(ctx: LayerContext, rate: float, local_heads: int, s: int) -> jax.Array:
    """``[b, local_heads, s, s]`` keep-mask of the attention probabilities, drawn per (query, key)
    token index (:func:`core.context_parallel.attention_dropout_mask`): the same values a
    context-parallel rank draws for its blocks."""
    positions = jnp.arange(s)
    return attention_dropout_mask(attention_dropout_head_keys(ctx, local_heads), positions, positions, rate)


class ParallelAttention(nn.Module):
    """Causal self-attention with heads split over tp (Megatron's ``SelfAttention``).

    The fused QKV weight is laid out by query group, as Megatron's: ``[groups, r + 2, head_dim]``
    rows (the group's ``r = heads / groups`` query heads, then its key, then its value; with
    one group per head, plain multi-head attention, that is ``[heads, 3, head_dim]``), so
    splitting its rows over tp gives each rank whole groups with their query heads. Its bias
    (``add_bias_linear`` or ``add_qkv_bias``) has the same row order. The heads are
    ``head_dim = kv_channels`` wide (default ``hidden / heads``): the QKV projection has
    ``(heads + 2 * groups) * head_dim`` rows and ``linear_proj`` ``heads * head_dim`` inputs.
    ``qk_layernorm`` normalises each query and key head (params ``q_layernorm`` and ``k_layernorm``,
    ``[head_dim]``) before rotary, as Megatron and Qwen3 do.
    """

    config: TransformerConfig
    """Model hyper-parameters."""

    @nn.compact
    def __call__(self, x: jax.Array, ctx: LayerContext | None = None) -> jax.Array:
        """``[s(/tp), b, h] -> [s(/tp), b, h]`` (before the residual add)."""
        cfg = self.config
        ctx = ctx if ctx is not None else LayerContext()
        h, heads, groups, head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
        r = heads // groups
        qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias
        qkv, _ = ColumnParallelLinear(h, (heads + 2 * groups) * head_dim, bias=qkv_bias,
                                      sequence_parallel=cfg.sequence_parallel, fp8=cfg.fp8_config,
                                      init_method=init_method_normal(cfg.init_method_std), name="linear_qkv")(x)
        s, b = qkv.shape[0], qkv.shape[1]
        local_groups = qkv.shape[-1] // ((r + 2) * head_dim)
        local_heads = local_groups * r
        layout = preferred_layout()  # the backend's attention reads it without a transpose
        if r == 1:
            q, k, v = split_qkv(qkv.reshape(s, b, local_heads, 3, head_dim), layout)
        else:
            q, k, v = split_qkv_grouped(qkv.reshape(s, b, local_groups, r + 2, head_dim), layout)
        if cfg.qk_layernorm:
            q, k = _qk_norm(cfg, "q_layernorm")(q), _qk_norm(cfg, "k_layernorm")(k)
        if cfg.position_embedding_type == "rope":
            rotary = partial(apply_rotary, base=cfg.rotary_base, layout=layout, positions=ctx.position_ids,
                             rotary_dim=cfg.rotary_dim, inv_freq=rotary_frequencies(cfg))
            q, k = rotary(q), rotary(k)
        if self.has_variable(KV_CACHE, "key"):  # inference (core.inference passes the layer's cache)
            out = self._cached_attention(q, k, v, ctx, layout)
        elif cfg.context_parallel_size > 1:
            # The local sequence is this cp rank's load-balanced chunks (the batch was reordered on
            # the host); the kernel masks by global position and exchanges K/V over "cp" (the ring
            # by all-gather on the CPU backend inside pipeline stages, see kv_rotation_for), or
            # (a2a, a2a+p2p) exchanges q/k/v for a head split of this rank's local heads. The
            # segment ids were reordered with the tokens, so they are the local tokens' own; the
            # dropout is drawn per global (query, key) index, the values one device draws.
            dropout = None
            if cfg.attention_dropout and ctx.dropout_seed is not None:
                dropout = (attention_dropout_head_keys(ctx, local_heads), cfg.attention_dropout)
            out = context_parallel_attention(q, k, v, comm_type=cfg.cp_comm_type, axis_name=CP_AXIS,
                                             causal=True, load_balanced=True, layout=layout,
                                             kv_rotation=kv_rotation_for(_in_pipeline_stage()),
                                             segment_ids=ctx.segment_ids, dropout=dropout,
                                             hierarchical_sizes=cfg.hierarchical_context_parallel_sizes,
                                             local_attention=causal_attention)
        else:
            keep = None
            if cfg.attention_dropout and ctx.dropout_seed is not None:
                keep = attention_dropout_keep(ctx, cfg.attention_dropout, local_heads, s)
            out = causal_attention(q, k, v, layout, segment_ids=ctx.segment_ids, dropout_keep=keep,
                                   dropout_rate=cfg.attention_dropout)
        out = jnp.transpose(out, _UNSPLIT[layout]).reshape(s, b, local_heads * head_dim)
        # Megatron scales the output projection's init by 1/sqrt(2 * num_layers).
        out, _ = RowParallelLinear(heads * head_dim, h, bias=cfg.add_bias_linear, input_is_parallel=True,
                                   sequence_parallel=cfg.sequence_parallel, fp8=cfg.fp8_config,
                                   init_method=init_method_normal(output_init_std(cfg)), name="linear_proj")(out)
        return out

    def _cached_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: LayerContext,
                          layout: str) -> jax.Array:
        """Inference: this rank's new keys and values written into the layer's KV cache (the
        ``"cache"`` collection, ``key`` / ``value`` ``[b, local groups, T, head_dim]``, slot =
        position) at each row's ``position_ids``, and attention of the new queries over the cache
        (a query at position ``p`` reads slots ``0..p`` of its own row; ``ctx.prefill``: over the
        new tokens alone, which start at slot 0)."""
        key_cache, value_cache = self.variable(KV_CACHE, "key"), self.variable(KV_CACHE, "value")
        positions = ctx.position_ids
        k_new, v_new = (_to_bnsd(x, layout).astype(key_cache.value.dtype) for x in (k, v))
        starts = jnp.zeros(k.shape[0], jnp.int32) if ctx.prefill else positions[:, 0].astype(jnp.int32)
        write = jax.vmap(lambda cache, new, start: lax.dynamic_update_slice_in_dim(cache, new, start, axis=1))
        key_cache.value = write(key_cache.value, k_new, starts)
        value_cache.value = write(value_cache.value, v_new, starts)
        if ctx.prefill:
            return causal_attention(q, k, v, layout)
        out = attention_over_cache(_to_bnsd(q, layout), key_cache.value, value_cache.value, positions)
        return out if layout == "bnsd" else jnp.swapaxes(out, 1, 2)


KV_CACHE = "cache"
"""The flax collection holding each attention layer's KV cache during inference (flax's name)."""


def _to_bnsd(x: jax.Array, layout: str) -> jax.Array:
    return x if layout == "bnsd" else jnp.swapaxes(x, 1, 2)


def attention_over_cache(q: jax.Array, key_cache: jax.Array, value_cache: jax.Array,
                         positions: jax.Array) -> jax.Array:
    """``softmax(q k^T / sqrt(d)) v`` of queries ``[b, heads, s, d]`` at ``positions`` ``[b, s]``
    over a KV cache ``[b, groups, T, d]`` (slot = position; query head ``g * r + i`` reads group
    ``g``, ``r = heads / groups``): each query sees the slots up to its own position, so slots
    beyond a row's written length never count. Float32 scores and softmax; ``q``'s dtype out."""
    b, heads, s, d = q.shape
    groups, slots = key_cache.shape[1], key_cache.shape[2]
    r = heads // groups
    qg = q.reshape(b, groups, r * s, d)  # row i * s + j: head g * r + i, token j
    scores = jnp.einsum("bgqd,bgtd->bgqt", qg, key_cache, preferred_element_type=jnp.float32) / float(d) ** 0.5
    visible = jnp.arange(slots)[None, None, :] <= positions[:, :, None]  # [b, s, T]
    visible = jnp.tile(visible, (1, r, 1))[:, None]  # [b, 1, r * s, T]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bgqt,bgtd->bgqd", probs.astype(value_cache.dtype), value_cache,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, heads, s, d).astype(q.dtype)


def rotary_frequencies(cfg: TransformerConfig) -> jax.Array:
    """The ``[rotary_dim / 2]`` rotary frequencies, Llama 3.1-scaled with ``rope_scaling``."""
    inv_freq = inverse_frequencies(cfg.rotary_base, cfg.rotary_dim)
    if not cfg.rope_scaling:
        return inv_freq
    return llama3_scaled_frequencies(inv_freq, cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor,
                                     cfg.rope_scaling_high_freq_factor,
                                     cfg.rope_scaling_original_max_position_embeddings)


def _qk_norm(cfg: TransformerConfig, name: str) -> nn.Module:
    """The configured norm over each head's ``head_dim`` channels. Its input is this rank's heads
    over the whole (local) sequence, so its grads are partial per tp rank with or without
    sequence parallelism (``tp_partial_grad``), never ``sequence_parallel``-tagged."""
    return build_norm(cfg.normalization, cfg.layernorm_epsilon, False, name, tp_partial_grad=True)


def _in_pipeline_stage() -> bool:
    """Whether this trace runs inside a ``shard_map`` whose pipeline axis has more than one stage
    (the pipeline executor's stages do not run their collectives in step)."""
    try:
        return lax.axis_size(PP_AXIS) > 1
    except NameError:  # not under a mesh with a pipeline axis
        return False
