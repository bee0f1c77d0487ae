"""Cross entropy over logits whose vocabulary is split across tensor-parallel ranks.

``vocab_parallel_cross_entropy(logits, target)`` runs inside ``shard_map``: each tp rank holds
``[..., V/tp]`` logits of its vocabulary range. Forward: all-reduce MAX for stability, the
target logit from its owning rank (all-reduce SUM), the softmax denominator (all-reduce SUM).
Backward is local: ``softmax - (1 - s) * onehot - s / V`` times the incoming grad.

Label smoothing follows Megatron's definition — the target keeps ``1 - eps`` and each of the
other ``V - 1`` classes gets ``eps / (V - 1)``, i.e. ``loss = (1 - s) * nll - s * mean(log p)``
with ``s = eps * V / (V - 1)`` — but with the GLOBAL vocabulary size and the GLOBAL mean of the
log-probabilities. (Megatron uses the local ones at tp > 1, NVIDIA/Megatron-LM #737, #7464, so
its smoothed loss depends on the layout; this one does not.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from core.parallel_state import TP_AXIS


def _forward(logits, target, label_smoothing, axis_name):
    logits = logits.astype(jnp.float32)
    tp = lax.axis_size(axis_name)
    local_vocab = logits.shape[-1]
    vocab = local_vocab * tp
    start = lax.axis_index(axis_name) * local_vocab
    logits_max = lax.pmax(jnp.max(logits, axis=-1), axis_name)
    z = logits - lax.stop_gradient(logits_max)[..., None]
    local_target = target - start
    in_range = (local_target >= 0) & (local_target < local_vocab)
    safe = jnp.where(in_range, local_target, 0)
    predicted = jnp.take_along_axis(z, safe[..., None], axis=-1)[..., 0]
    predicted = lax.psum(jnp.where(in_range, predicted, 0.0), axis_name)
    exp_z = jnp.exp(z)
    sum_exp = lax.psum(jnp.sum(exp_z, axis=-1), axis_name)
    log_sum = jnp.log(sum_exp)
    loss = log_sum - predicted
    if label_smoothing > 0:
        smoothing = label_smoothing * vocab / (vocab - 1)
        mean_log_probs = lax.psum(jnp.sum(z, axis=-1), axis_name) / vocab - log_sum
        loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
    softmax = exp_z / sum_exp[..., None]
    return loss, (softmax, safe, in_range)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _vocab_parallel_cross_entropy(logits, target, label_smoothing, axis_name):
    return _forward(logits, target, label_smoothing, axis_name)[0]


def _fwd(logits, target, label_smoothing, axis_name):
    loss, res = _forward(logits, target, label_smoothing, axis_name)
    return loss, (*res, jnp.zeros((), logits.dtype))  # the last entry only carries the dtype


def _bwd(label_smoothing, axis_name, residuals, g):
    softmax, safe, in_range, dtype_marker = residuals
    dtype = dtype_marker.dtype
    vocab = softmax.shape[-1] * lax.axis_size(axis_name)
    smoothing = label_smoothing * vocab / (vocab - 1) if label_smoothing > 0 else 0.0
    onehot = jax.nn.one_hot(safe, softmax.shape[-1], dtype=softmax.dtype) * in_range[..., None]
    grad = softmax - (1.0 - smoothing) * onehot - smoothing / vocab
    return (grad * g[..., None]).astype(dtype), None


_vocab_parallel_cross_entropy.defvjp(_fwd, _bwd)


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: jax.Array, target: jax.Array, label_smoothing: float = 0.0, axis_name: str = TP_AXIS
) -> jax.Array:
    """Per-token cross entropy (shape of ``target``) from vocabulary-split logits; see module doc."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _vocab_parallel_cross_entropy(vocab_parallel_logits, target, float(label_smoothing), axis_name)
