"""The MLP block (Megatron's ``MLP``): pre-norm, column-parallel ``fc1`` (GELU or SwiGLU),
row-parallel ``fc2``, output dropout and the residual add, on ``[s(/tp), b, h]`` activations."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from core.fp8 import FP8Config
from core.parallel_state import TP_AXIS
from core.tensor_parallel.fast_vjp import gelu
from core.tensor_parallel.layers import ColumnParallelLinear, Initializer, RowParallelLinear, default_init_method
from core.tensor_parallel.random import sequence_parallel_dropout
from core.transformer.norms import build_norm


class ParallelMLP(nn.Module):
    """Pre-norm MLP block: norm -> ColumnParallel(gelu, or SwiGLU) -> RowParallel, plus the residual.

    With ``sequence_parallel`` the input and output are ``[s/tp, b, h]`` sequence shards: the
    norm and the output dropout run on the shard (norm params tagged ``sequence_parallel``,
    dropout masks sliced from the full-sequence mask so they do not depend on the layout), the
    column layer all-gathers the sequence and the row layer reduce-scatters it.

    With ``gated_linear_unit`` (Megatron's ``--swiglu``) the block is
    ``fc2(silu(x W_gate) * (x W_up))``: ``fc1`` holds the gate and up weights stacked
    (``[2, ffn, h]``, the ffn dim split over tp), so each rank gates its own ffn slice.
    """

    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """MLP width (split over tp)."""
    sequence_parallel: bool = False
    """Sequence parallelism (see class docstring)."""
    hidden_dropout: float = 0.0
    """Dropout rate on the block output before the residual add (needs a ``"dropout"`` rng)."""
    deterministic: bool = True
    """Disable dropout (evaluation)."""
    axis_name: str = TP_AXIS
    """Tensor-parallel mesh axis."""
    gated_linear_unit: bool = False
    """SwiGLU instead of gelu (see class docstring)."""
    bias: bool = True
    """Biases on ``fc1`` and ``fc2`` (False: Megatron's ``--disable-bias-linear``)."""
    normalization: str = "LayerNorm"
    """The pre-norm: ``"LayerNorm"`` or ``"RMSNorm"``."""
    epsilon: float = 1e-6
    """The pre-norm's epsilon (the default is flax's; GPT passes ``layernorm_epsilon``)."""
    init_method: Initializer = default_init_method
    """``fc1``'s weight initializer (global shape)."""
    output_layer_init_method: Initializer = default_init_method
    """``fc2``'s weight initializer (global shape; Megatron scales its std by ``1/sqrt(2 L)``)."""
    fp8: FP8Config | None = None
    """FP8 GEMMs in ``fc1`` and ``fc2`` (``core.fp8``; None: high precision)."""

    @nn.compact
    def __call__(self, x: jax.Array, dropout_fn: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
        """``x + Dropout(MLP(Norm(x)))``; ``dropout_fn``, when given, replaces the rng-driven
        dropout on the block output (e.g. GPT's layout-invariant per-sample masks)."""
        sp = self.sequence_parallel
        h = build_norm(self.normalization, self.epsilon, sp, "layernorm")(x)
        stack = 2 if self.gated_linear_unit else 1
        h, _ = ColumnParallelLinear(self.hidden_size, self.ffn_hidden_size, bias=self.bias, sequence_parallel=sp,
                                    init_method=self.init_method, axis_name=self.axis_name, num_stacked=stack,
                                    fp8=self.fp8, name="fc1")(h)
        if self.gated_linear_unit:
            gate, up = jnp.split(h, 2, axis=-1)
            h = jax.nn.silu(gate) * up
        else:
            h = gelu(h)
        h, _ = RowParallelLinear(self.ffn_hidden_size, self.hidden_size, bias=self.bias, input_is_parallel=True,
                                 sequence_parallel=sp, init_method=self.output_layer_init_method,
                                 axis_name=self.axis_name, fp8=self.fp8, name="fc2")(h)
        if dropout_fn is not None:
            h = dropout_fn(h)
        elif self.hidden_dropout and not self.deterministic:
            h = sequence_parallel_dropout(self.make_rng("dropout"), h, self.hidden_dropout, sp, self.axis_name)
        return x + h
