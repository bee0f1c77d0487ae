"""``SharedExpertMLP``: the shared expert, a dense tensor-parallel MLP every token goes through.

Megatron's ``--moe-shared-expert-intermediate-size``: its output is added to the routed experts'.
Unlike the routed experts it is split over tp like ``ParallelMLP`` (column-parallel ``fc1``, row-
parallel ``fc2``; under sequence parallelism all-gather before and reduce-scatter after), and its
parameters are dense (reduced over the whole data-parallel group). With an enabled ``fp8`` config
its fc1 and fc2 run in FP8 as ``ParallelMLP``'s (:func:`core.fp8.fp8_linear`).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from core.fp8 import FP8Config
from core.parallel_state import TP_AXIS
from core.tensor_parallel.fast_vjp import gelu
from core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, default_init_method


class SharedExpertMLP(nn.Module):
    """``fc2(act(fc1(x)))`` on ``[s(/tp), b, h]`` activations, GELU or SwiGLU, optional biases."""

    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """Shared expert width (split over tp)."""
    gated_linear_unit: bool = False
    """SwiGLU instead of GELU (``fc1`` stacks gate and up, as ``ParallelMLP``)."""
    bias: bool = True
    """Biases on ``fc1`` and ``fc2``."""
    sequence_parallel: bool = False
    """Input and output are ``[s/tp, b, h]`` sequence shards."""
    init_method: Callable[..., jax.Array] = default_init_method
    """``fc1`` weight initializer (global shape)."""
    output_layer_init_method: Callable[..., jax.Array] = default_init_method
    """``fc2`` weight initializer (global shape)."""
    axis_name: str = TP_AXIS
    """Tensor-parallel mesh axis."""
    fp8: FP8Config | None = None
    """FP8 GEMMs in ``fc1`` and ``fc2`` (``core.fp8``; None: high precision)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """The shared expert's output for every token of ``x``."""
        sp = self.sequence_parallel
        h, _ = ColumnParallelLinear(self.hidden_size, self.ffn_hidden_size, bias=self.bias, sequence_parallel=sp,
                                    init_method=self.init_method, axis_name=self.axis_name,
                                    num_stacked=2 if self.gated_linear_unit else 1, fp8=self.fp8, name="fc1")(x)
        if self.gated_linear_unit:
            gate, up = jnp.split(h, 2, axis=-1)
            h = jax.nn.silu(gate) * up
        else:
            h = gelu(h)
        y, _ = RowParallelLinear(self.ffn_hidden_size, self.hidden_size, bias=self.bias, input_is_parallel=True,
                                 sequence_parallel=sp, init_method=self.output_layer_init_method,
                                 axis_name=self.axis_name, fp8=self.fp8, name="fc2")(h)
        return y
