"""Megatron's tensor-parallel layers as flax linen modules (run inside ``jax.shard_map``).

Shapes follow Megatron: activations ``[s, b, h]`` (sequence first, so sequence parallelism
splits dim 0), ``ColumnParallelLinear`` weight ``[out/tp, in]``, ``RowParallelLinear`` weight
``[out, in/tp]``, ``VocabParallelEmbedding`` weight ``[V/tp, h]``. Inside ``shard_map`` the
modules create their *local* shards; every parameter declares how it is split
(``core.param_metadata``) so DDP, ``finalize_model_grads`` and checkpoints can read it, and is
initialised tensor-parallel-invariantly (the tp=1 weight split k ways).

With an enabled ``fp8`` config the linear layers' GEMMs run in FP8 (:func:`core.fp8.fp8_linear`);
the embedding never does (Transformer Engine keeps embeddings in high precision).

Linear layers return ``(output, bias)`` like Megatron: ``bias`` is None unless
``skip_bias_add``, in which case it is returned unadded for fusion by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from core.fp8 import FP8Config, fp8_linear, module_scale
from core.parallel_state import TP_AXIS
from core.param_metadata import with_parallel_metadata
from core.tensor_parallel.fast_vjp import linear
from core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from core.tensor_parallel.random import tensor_parallel_init
from core.tensor_parallel.utils import divide

Initializer = Callable[..., jax.Array]


def default_init_method(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """Megatron's ``init_method_normal(0.02)``."""
    return jax.random.normal(key, shape, dtype) * 0.02


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output dim: each tp rank computes ``Y_i``."""

    input_size: int
    """Input features (global)."""
    output_size: int
    """Output features (global); split over tp."""
    bias: bool = True
    """Add a (tp-split) bias."""
    gather_output: bool = False
    """All-gather the output's last dim (else each rank keeps its output shard)."""
    skip_bias_add: bool = False
    """Return the bias instead of adding it."""
    sequence_parallel: bool = False
    """Input is split over the sequence dim (0); all-gather it first (Megatron SP)."""
    init_method: Initializer = default_init_method
    """Weight initializer, called with the global shape."""
    params_dtype: Any = jnp.float32
    """Parameter dtype."""
    axis_name: str = TP_AXIS
    """Tensor-parallel mesh axis."""
    fp8: FP8Config | None = None
    """FP8 GEMMs (``core.fp8``) when enabled; under the delayed recipe the scales come from the
    ``"fp8_scale"`` collection (:func:`core.fp8.module_scale`)."""
    num_stacked: int = 1
    """Independent projections of the same input computed as one matmul (e.g. SwiGLU's gate and
    up): above 1 the weight is ``[num_stacked, out/tp, in]`` (global ``[num_stacked, out, in]``,
    split over tp along dim 1) and the output ``[..., num_stacked * out/tp]``, stacked-major.
    Each rank then holds the matching slice of every projection, and the global weight does
    not depend on tp (a fused ``[num_stacked * out, in]`` weight split along dim 0 would give
    rank 0 only gate rows)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """Apply the layer; returns ``(output, bias or None)``."""
        tp = lax.axis_size(self.axis_name)
        if self.gather_output and self.sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output is not supported with sequence_parallel")
        if self.gather_output and self.num_stacked > 1:
            raise ValueError("ColumnParallelLinear: gather_output is not supported with num_stacked > 1")
        out_local = divide(self.output_size, tp)
        stacked = self.num_stacked > 1
        lead = (self.num_stacked,) if stacked else ()
        lead_names = (None,) if stacked else ()
        weight = self.param("weight", with_parallel_metadata(
            tensor_parallel_init(self.init_method, len(lead), self.axis_name), lead_names + (self.axis_name, None)),
            lead + (out_local, self.input_size), self.params_dtype)
        weight = weight.reshape(-1, self.input_size)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, True, self.axis_name)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.axis_name)
        b = None
        if self.bias:
            b = self.param("bias", with_parallel_metadata(nn.initializers.zeros, lead_names + (self.axis_name,)),
                           lead + (out_local,), self.params_dtype).reshape(-1)
        if b is not None and not self.skip_bias_add:
            y, b = _linear(x, weight, b, self.fp8, module_scale(self, self.fp8)), None
        else:
            y = _linear(x, weight, None, self.fp8, module_scale(self, self.fp8))
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.axis_name)
        return y, b


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input dim; partial results all-reduced."""

    input_size: int
    """Input features (global); split over tp."""
    output_size: int
    """Output features (global)."""
    bias: bool = True
    """Add a (replicated) bias after the reduction."""
    input_is_parallel: bool = False
    """Input already split over tp along its last dim (else it is scattered first)."""
    skip_bias_add: bool = False
    """Return the bias instead of adding it."""
    sequence_parallel: bool = False
    """Reduce-scatter the output over the sequence dim instead of all-reducing it."""
    init_method: Initializer = default_init_method
    """Weight initializer, called with the global shape."""
    params_dtype: Any = jnp.float32
    """Parameter dtype."""
    axis_name: str = TP_AXIS
    """Tensor-parallel mesh axis."""
    fp8: FP8Config | None = None
    """FP8 GEMMs (``core.fp8``) when enabled; under the delayed recipe the scales come from the
    ``"fp8_scale"`` collection (:func:`core.fp8.module_scale`)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """Apply the layer; returns ``(output, bias or None)``."""
        tp = lax.axis_size(self.axis_name)
        if self.sequence_parallel and not self.input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        weight = self.param("weight", with_parallel_metadata(
            tensor_parallel_init(self.init_method, 1, self.axis_name), (None, self.axis_name)),
            (self.output_size, divide(self.input_size, tp)), self.params_dtype)
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.axis_name)
        y = _linear(x, weight, None, self.fp8, module_scale(self, self.fp8))
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.axis_name)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.axis_name)
        b = None
        if self.bias:
            # Replicated over tp; under SP it sees only this rank's sequence shard, so its grad
            # must be summed over tp (finalize_model_grads reads the flag).
            b = self.param("bias", with_parallel_metadata(nn.initializers.zeros, (None,),
                                                          sequence_parallel=self.sequence_parallel),
                           (self.output_size,), self.params_dtype)
            if not self.skip_bias_add:
                y, b = y + b, None
        return y, b


def _linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None, fp8: FP8Config | None,
            scale: jax.Array | None) -> jax.Array:
    """``x @ weight.T (+ bias)``, with FP8 GEMMs when ``fp8`` is enabled (``scale``: the delayed
    recipe's scales)."""
    if fp8 is None or not fp8.enabled:
        return linear(x, weight, bias)
    return fp8_linear(x, weight, bias, config=fp8, scale=scale)


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over tp: ids outside this rank's range give zeros."""

    num_embeddings: int
    """Vocabulary size (global); split over tp."""
    embedding_dim: int
    """Hidden size."""
    reduce_scatter_embeddings: bool = False
    """Output ``[s/tp, b, h]`` via reduce-scatter (sequence parallelism) instead of ``[b, s, h]``."""
    init_method: Initializer = default_init_method
    """Weight initializer, called with the global shape."""
    params_dtype: Any = jnp.float32
    """Parameter dtype."""
    shared_embedding: bool = False
    """Mark the weight as the word embedding tied to the output layer."""
    axis_name: str = TP_AXIS
    """Tensor-parallel mesh axis."""

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        """Look up ``ids`` of shape ``[b, s]``."""
        tp = lax.axis_size(self.axis_name)
        local = divide(self.num_embeddings, tp)
        weight = self.param("weight", with_parallel_metadata(
            tensor_parallel_init(self.init_method, 0, self.axis_name), (self.axis_name, None),
            shared_embedding=self.shared_embedding), (local, self.embedding_dim), self.params_dtype)
        start = lax.axis_index(self.axis_name) * local
        local_ids = ids - start
        valid = (local_ids >= 0) & (local_ids < local)
        out = jnp.where(valid[..., None], weight[jnp.where(valid, local_ids, 0)], 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(jnp.swapaxes(out, 0, 1), self.axis_name)
        return reduce_from_tensor_model_parallel_region(out, self.axis_name)
