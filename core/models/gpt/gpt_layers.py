"""The GPT's own layers around the transformer layers: the embedding, the output head and the
language-model loss, as flax linen modules and functions run inside ``shard_map`` on local shards.

A microbatch is a dict: ``"tokens"`` and ``"labels"`` ``[b, s]`` int32, and optionally
``"loss_mask"`` ``[b, s]`` float32 (absent: all ones), ``"position_ids"``, ``"segment_ids"`` and
``"dropout_seed"`` (what the layers read through a
:class:`~core.transformer.layer_context.LayerContext`: positions, the document-causal mask,
per-sample dropout seeds). The layers themselves live in ``core.transformer``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from core.distributed.loss_normalization import sequence_mean
from core.models.gpt.gpt_config import GPTConfig
from core.parallel_state import TP_AXIS
from core.param_metadata import with_parallel_metadata
from core.tensor_parallel import (
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    tensor_parallel_init,
    vocab_parallel_cross_entropy,
)
from core.tensor_parallel.fast_vjp import linear
from core.tensor_parallel.layers import default_init_method
from core.tensor_parallel.utils import divide
from core.transformer.layer_context import DROPOUT_EMBEDDING, LayerContext, hidden_dropout
from core.transformer.transformer_layer import layer_norm
from core.transformer.utils import init_method_normal


def _padded_rows(init, rows: int):
    """``init`` drawn for ``rows`` rows (the real vocabulary) with zero rows appended up to the
    requested (padded) shape: the real rows do not depend on the padding."""

    def fn(key, shape, dtype=jnp.float32):
        if shape[0] == rows:
            return init(key, shape, dtype)
        real = init(key, (rows,) + tuple(shape[1:]), dtype)
        return jnp.concatenate([real, jnp.zeros((shape[0] - rows,) + tuple(shape[1:]), dtype)])

    return fn



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
                                   init_method=_padded_rows(init_method_normal(cfg.init_method_std), cfg.vocab_size),
                                   shared_embedding=True, name="word_embeddings")(tokens)
        if not sp:
            x = jnp.swapaxes(x, 0, 1)  # [b, s, h] -> [s, b, h]
        if cfg.position_embedding_type == "learned_absolute":
            init = with_parallel_metadata(init_method_normal(cfg.init_method_std), (None, None), sequence_parallel=sp)
            table = self.param("position_embeddings", init, (cfg.seq_length, cfg.hidden_size))
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
