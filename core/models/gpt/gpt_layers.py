"""GPT building blocks as flax linen modules, run inside ``shard_map`` on local shards.

Activations are ``[s, b, h]`` (Megatron's layout), ``[s/tp, b, h]`` under sequence parallelism.
Every parameter is initialised tensor-parallel-invariantly (the tp=1 weight split k ways) and
declares its split (``core.param_metadata``), so the model is the same whatever the layout.

A microbatch is a dict: ``"tokens"`` and ``"labels"`` ``[b, s]`` int32, and optionally
``"loss_mask"`` ``[b, s]`` float32 (absent: all ones), ``"position_ids"`` ``[b, s]`` int32
(absent: ``arange(s)``; read by learned positions and rotary), ``"segment_ids"`` ``[b, s]``
int32 (document-causal attention: a token sees earlier-or-same positions of its own segment)
and ``"dropout_seed"`` ``[b]`` int32 (training batches with dropout: without it no dropout
runs). The layers read them through a :class:`LayerContext`.

Dropout masks do not depend on the layout: sample ``i``'s key is ``fold_in(key(0),
dropout_seed[i])``, then the global layer index and a per-site tag are folded in, the mask is
drawn at the sample's global shape (``[s, h]`` for hidden dropout; ``[s, s]`` per global head
index for attention dropout) and each rank keeps what it holds (its sequence shard under
sequence parallelism, its heads under tp).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from core.context_parallel import attention_dropout_mask, context_parallel_attention, cp_positions, kv_rotation_for
from core.distributed.loss_normalization import sequence_mean
from core.models.gpt.causal_attention import causal_attention, preferred_layout
from core.models.gpt.gpt_config import GPTConfig
from core.parallel_state import CP_AXIS, PP_AXIS, TP_AXIS
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
from core.tensor_parallel.layers import build_norm, default_init_method
from core.tensor_parallel.utils import divide
from core.transformer.moe import MoEBlock


def _normal(std: float):
    return lambda key, shape, dtype=jnp.float32: jax.random.normal(key, shape, dtype) * std


def _padded_rows(init, rows: int):
    """``init`` drawn for ``rows`` rows (the real vocabulary) with zero rows appended up to the
    requested (padded) shape: the real rows do not depend on the padding."""

    def fn(key, shape, dtype=jnp.float32):
        if shape[0] == rows:
            return init(key, shape, dtype)
        real = init(key, (rows,) + tuple(shape[1:]), dtype)
        return jnp.concatenate([real, jnp.zeros((shape[0] - rows,) + tuple(shape[1:]), dtype)])

    return fn


@flax.struct.dataclass
class LayerContext:
    """What the layers read from the microbatch besides the activations (see module docstring)."""

    position_ids: jax.Array | None = None
    """``[b, s]`` positions (None: ``arange(s)``)."""
    segment_ids: jax.Array | None = None
    """``[b, s]`` document ids for the document-causal mask (None: plain causal)."""
    dropout_seed: jax.Array | None = None
    """``[b]`` per-sample dropout seeds (None: no dropout)."""
    layer_index: Any = 0
    """Global index of the layer being run (folded into its dropout keys)."""

    @classmethod
    def from_batch(cls, batch: Any, layer_index: Any = 0) -> LayerContext:
        """The context of a microbatch dict (anything else, e.g. bare tokens, has no options)."""
        if not isinstance(batch, dict):
            return cls(layer_index=layer_index)
        return cls(batch.get("position_ids"), batch.get("segment_ids"), batch.get("dropout_seed"), layer_index)


# Dropout sites (folded into each sample's key after the layer index).
DROPOUT_EMBEDDING, DROPOUT_ATTENTION_PROBS, DROPOUT_ATTENTION_OUTPUT, DROPOUT_MLP_OUTPUT = range(4)


def dropout_keys(dropout_seed: jax.Array, layer_index: Any, site: int) -> jax.Array:
    """``[b]`` keys of one dropout site: ``fold_in(fold_in(fold_in(key(0), seed_i), layer), site)``."""
    base = jax.random.key(0)
    one = lambda seed: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, seed), layer_index), site)
    return jax.vmap(one)(dropout_seed)


def hidden_dropout(x: jax.Array, ctx: LayerContext | None, rate: float, site: int,
                   sequence_parallel: bool, context_parallel_size: int = 1) -> jax.Array:
    """Dropout on ``[s(/tp/cp), b, h]`` activations with each sample's ``[s, h]`` mask, drawn at
    the full sequence length and cut to the rows this rank holds (its sequence-parallel shard of
    its context-parallel chunks), so the mask of a token does not depend on the layout; the
    identity without a rate or a ``dropout_seed``."""
    if rate == 0.0 or ctx is None or ctx.dropout_seed is None:
        return x
    s_local, _, h = x.shape
    tp = lax.axis_size(TP_AXIS) if sequence_parallel else 1
    s_full = s_local * tp * context_parallel_size
    keys = dropout_keys(ctx.dropout_seed, ctx.layer_index, site)
    keep = jnp.swapaxes(jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, (s_full, h)))(keys), 0, 1)
    start = lax.axis_index(TP_AXIS) * s_local if sequence_parallel else 0
    if context_parallel_size > 1:  # the load-balanced chunks' global rows, then this tp rank's part
        rows = cp_positions(lax.axis_index(CP_AXIS), s_full, context_parallel_size)
        keep = jnp.take(keep, lax.dynamic_slice_in_dim(rows, start, s_local), axis=0)
    elif sequence_parallel:
        keep = lax.dynamic_slice_in_dim(keep, start, s_local, axis=0)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


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


def layer_norm(config: GPTConfig, name: str) -> nn.Module:
    """The configured norm (``config.normalization``: LayerNorm or RMSNorm, epsilon
    ``layernorm_epsilon``), params tagged sequence-parallel when the activations are shards."""
    return build_norm(config.normalization, config.layernorm_epsilon, config.sequence_parallel, name)


def apply_rotary(x: jax.Array, base: float, layout: str = "bnsd", positions: jax.Array | None = None,
                 rotary_dim: int | None = None) -> jax.Array:
    """Rotary position embedding on ``[b, heads, s, d]`` (``layout="bnsd"``) or ``[b, s, heads,
    d]`` (``"bsnd"``), rotate-half form: positions ``positions`` (``[b, s]``; default 0..s-1),
    only the first ``rotary_dim`` channels of each head rotated (default all; Megatron's
    ``rotary_percent``, frequencies over the rotated width), the rest passed through."""
    seq_axis = layout.index("s")
    s, d = x.shape[seq_axis], x.shape[-1]
    rot = d if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (base ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    if positions is None:
        angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None, :]
        if seq_axis == 1:  # [s, d] -> [s, 1, d], broadcast over the heads that follow the sequence
            angles = angles[:, None, :]
    else:  # [b, s, d/2] -> [b, 1, s, d/2] (bnsd) or [b, s, 1, d/2] (bsnd)
        angles = positions.astype(jnp.float32)[..., None] * inv_freq
        angles = angles[:, None] if seq_axis == 2 else angles[:, :, None]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)
    xr = x if rot == d else x[..., :rot]
    x1, x2 = jnp.split(xr.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = xr.astype(jnp.float32) * cos + rotated * sin
    if rot != d:
        out = jnp.concatenate([out, x[..., rot:].astype(jnp.float32)], axis=-1)
    return out.astype(x.dtype)


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


class ParallelAttention(nn.Module):
    """Causal self-attention with heads split over tp (Megatron's ``SelfAttention``).

    The fused QKV weight is laid out by query group, as Megatron's: ``[groups, r + 2, head_dim]``
    rows (the group's ``r = heads / groups`` query heads, then its key, then its value; with
    one group per head, plain multi-head attention, that is ``[heads, 3, head_dim]``), so
    splitting its rows over tp gives each rank whole groups with their query heads.
    """

    config: GPTConfig
    """Model hyper-parameters."""

    @nn.compact
    def __call__(self, x: jax.Array, ctx: LayerContext | None = None) -> jax.Array:
        """``[s(/tp), b, h] -> [s(/tp), b, h]`` (before the residual add)."""
        cfg = self.config
        ctx = ctx if ctx is not None else LayerContext()
        h, heads, groups, head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
        r = heads // groups
        qkv, _ = ColumnParallelLinear(h, (heads + 2 * groups) * head_dim, bias=cfg.add_bias_linear,
                                      sequence_parallel=cfg.sequence_parallel,
                                      init_method=_normal(cfg.init_method_std), name="linear_qkv")(x)
        s, b = qkv.shape[0], qkv.shape[1]
        local_groups = qkv.shape[-1] // ((r + 2) * head_dim)
        local_heads = local_groups * r
        layout = preferred_layout()  # the backend's attention reads it without a transpose
        if r == 1:
            q, k, v = split_qkv(qkv.reshape(s, b, local_heads, 3, head_dim), layout)
        else:
            q, k, v = split_qkv_grouped(qkv.reshape(s, b, local_groups, r + 2, head_dim), layout)
        if cfg.position_embedding_type == "rope":
            rotary = partial(apply_rotary, base=cfg.rotary_base, layout=layout, positions=ctx.position_ids,
                             rotary_dim=cfg.rotary_dim)
            q, k = rotary(q), rotary(k)
        if cfg.context_parallel_size > 1:
            # The local sequence is this cp rank's load-balanced chunks (the batch was reordered on
            # the host); the kernel masks by global position and exchanges K/V over "cp" (the ring
            # by all-gather on the CPU backend inside pipeline stages, see kv_rotation_for). The
            # segment ids were reordered with the tokens, so they are the local tokens' own; the
            # dropout is drawn per global (query, key) index, the values one device draws.
            dropout = None
            if cfg.attention_dropout and ctx.dropout_seed is not None:
                dropout = (attention_dropout_head_keys(ctx, local_heads), cfg.attention_dropout)
            out = context_parallel_attention(q, k, v, comm_type=cfg.cp_comm_type, axis_name=CP_AXIS,
                                             causal=True, load_balanced=True, layout=layout,
                                             kv_rotation=kv_rotation_for(_in_pipeline_stage()),
                                             segment_ids=ctx.segment_ids, dropout=dropout)
        else:
            keep = None
            if cfg.attention_dropout and ctx.dropout_seed is not None:
                keep = attention_dropout_keep(ctx, cfg.attention_dropout, local_heads, s)
            out = causal_attention(q, k, v, layout, segment_ids=ctx.segment_ids, dropout_keep=keep,
                                   dropout_rate=cfg.attention_dropout)
        out = jnp.transpose(out, _UNSPLIT[layout]).reshape(s, b, local_heads * head_dim)
        # Megatron scales the output projection's init by 1/sqrt(2 * num_layers).
        out, _ = RowParallelLinear(h, h, bias=cfg.add_bias_linear, input_is_parallel=True,
                                   sequence_parallel=cfg.sequence_parallel,
                                   init_method=_normal(output_init_std(cfg)), name="linear_proj")(out)
        return out


def _in_pipeline_stage() -> bool:
    """Whether this trace runs inside a ``shard_map`` whose pipeline axis has more than one stage
    (the pipeline executor's stages do not run their collectives in step)."""
    try:
        return lax.axis_size(PP_AXIS) > 1
    except NameError:  # not under a mesh with a pipeline axis
        return False


def output_init_std(config: GPTConfig) -> float:
    """Megatron's scaled init of the layers' output projections: ``std / sqrt(2 * num_layers)``."""
    return config.init_method_std / (2.0 * config.num_layers) ** 0.5


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: ``x + Dropout(Attn(Norm(x)))``, then ``y + Dropout(MLP(Norm(y)))``."""

    config: GPTConfig
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
                             epsilon=cfg.layernorm_epsilon, init_method=_normal(cfg.init_method_std),
                             output_layer_init_method=_normal(output_init_std(cfg)), name="mlp")
            return block(x, dropout_fn)
        mlp = ParallelMLP(cfg.hidden_size, cfg.ffn_size, sequence_parallel=sp, gated_linear_unit=cfg.swiglu,
                          bias=cfg.add_bias_linear, normalization=cfg.normalization, epsilon=cfg.layernorm_epsilon,
                          init_method=_normal(cfg.init_method_std),
                          output_layer_init_method=_normal(output_init_std(cfg)), name="mlp")
        return mlp(x, dropout_fn)


class GPTEmbedding(nn.Module):
    """Word embedding (vocabulary split over tp) plus learned absolute positions, then hidden dropout.

    Returns ``[s, b, h]``, or this rank's ``[s/tp, b, h]`` shard under sequence parallelism.
    """

    config: GPTConfig
    """Model hyper-parameters."""

    @nn.compact
    def __call__(self, tokens: jax.Array, ctx: LayerContext | None = None) -> jax.Array:
        """Embed ``[b, s]`` token ids (positions and dropout seeds from ``ctx``)."""
        cfg = self.config
        ctx = ctx if ctx is not None else LayerContext()
        sp = cfg.sequence_parallel
        x = VocabParallelEmbedding(cfg.vocab_rows, cfg.hidden_size, reduce_scatter_embeddings=sp,
                                   init_method=_padded_rows(_normal(cfg.init_method_std), cfg.vocab_size),
                                   shared_embedding=True, name="word_embeddings")(tokens)
        if not sp:
            x = jnp.swapaxes(x, 0, 1)  # [b, s, h] -> [s, b, h]
        if cfg.position_embedding_type == "learned_absolute":
            table = self.param("position_embeddings", with_parallel_metadata(
                _normal(cfg.init_method_std), (None, None), sequence_parallel=sp), (cfg.seq_length, cfg.hidden_size))
            s_local = x.shape[0]
            start = lax.axis_index("tp") * s_local if sp else 0
            if ctx.position_ids is None:
                x = x + lax.dynamic_slice_in_dim(table, start, s_local, axis=0)[:, None, :]
            else:  # gather each token's row; under SP only this rank's sequence shard
                positions = lax.dynamic_slice_in_dim(ctx.position_ids, start, s_local, axis=1)
                x = x + jnp.swapaxes(table[positions], 0, 1)
        return hidden_dropout(x, ctx.replace(layer_index=0), cfg.hidden_dropout, DROPOUT_EMBEDDING, sp,
                              cfg.context_parallel_size)


class GPTOutputHead(nn.Module):
    """Final norm and, when untied, the output layer's own ``[V/tp, h]`` weight (``V`` the padded
    vocabulary: padding rows initialised to zero)."""

    config: GPTConfig
    """Model hyper-parameters."""

    @nn.compact
    def __call__(self, x: jax.Array, word_embeddings: jax.Array | None) -> jax.Array:
        """Vocabulary-split logits ``[s, b, V/tp]`` from ``[s(/tp), b, h]`` activations."""
        cfg = self.config
        x = layer_norm(cfg, "final_layernorm")(x)
        weight = word_embeddings
        if weight is None:
            local = divide(cfg.vocab_rows, lax.axis_size("tp"))
            weight = self.param("output_layer", with_parallel_metadata(
                tensor_parallel_init(_padded_rows(default_init_method, cfg.vocab_size), 0), ("tp", None)),
                (local, cfg.hidden_size))
        if cfg.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, True)
        else:
            x = copy_to_tensor_model_parallel_region(x)
        return linear(x, weight.astype(x.dtype))


def mask_padded_logits(logits: jax.Array, vocab_size: int, axis_name: str = TP_AXIS) -> jax.Array:
    """Vocabulary-split logits ``[..., V/tp]`` with the padding ids (``>= vocab_size``, this
    rank's global id range ``rank * V/tp ...``) set to the dtype's lowest value: they never win
    the softmax, get zero probability and so carry no loss or gradient."""
    local = logits.shape[-1]
    if local * lax.axis_size(axis_name) <= vocab_size:
        return logits
    ids = lax.axis_index(axis_name) * local + jnp.arange(local)
    return jnp.where(ids < vocab_size, logits, jnp.finfo(logits.dtype).min)


def language_model_loss_terms(logits: jax.Array, labels: jax.Array, loss_mask: jax.Array | None = None,
                              vocab_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Next-token cross entropy of vocabulary-split ``[s, b, V/tp]`` logits and ``[b, s]`` labels as
    the loss contract's terms: ``(sum of the token losses, number of tokens)`` over this rank's
    tokens, each token weighted by ``loss_mask`` (``[b, s]``; all ones without it).
    ``vocab_size`` below the logits' (padded) vocabulary masks the padding ids first
    (:func:`mask_padded_logits`)."""
    if vocab_size is not None:
        logits = mask_padded_logits(logits, vocab_size)
    losses = vocab_parallel_cross_entropy(logits, jnp.swapaxes(labels, 0, 1))
    if loss_mask is None:
        return jnp.sum(losses), jnp.asarray(losses.size, jnp.float32)
    mask = jnp.swapaxes(loss_mask, 0, 1).astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)


def language_model_loss(logits: jax.Array, labels: jax.Array, loss_mask: jax.Array | None = None,
                        vocab_size: int | None = None, context_parallel_axis: str | None = None) -> jax.Array:
    """The mean of :func:`language_model_loss_terms`: Megatron's ``sum(loss * mask) / sum(mask)``
    (denominator at least 1). ``context_parallel_axis``: the sequence is split over this mesh axis
    (``"cp"``); the value is then the whole sequence's loss on every cp rank and the gradient
    ``cp`` times this rank's share (:func:`~core.distributed.loss_normalization.sequence_mean`)."""
    return sequence_mean(*language_model_loss_terms(logits, labels, loss_mask, vocab_size), context_parallel_axis)
