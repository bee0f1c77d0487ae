"""The routed experts: ``GroupedMLP`` (all local experts at once: ``jax.lax.ragged_dot`` grouped GEMMs,
on the CPU batched matmuls over windows of each expert's rows, see
:mod:`core.transformer.moe.grouped_gemm`) and
``SequentialMLP`` (a loop over the local experts), with the same parameters.

Both take the rows the dispatcher grouped by local expert, ``rows [M, h]`` with
``group_sizes [E_local]`` (rows ``sum(group_sizes):`` are padding; their outputs are ignored), and
return ``[M, h]``. The expert MLP is ``fc2(act(fc1(x)))`` with GELU (tanh form, as the dense
``ParallelMLP``) or SwiGLU (``silu(x W_gate) * (x W_up)``), biases optional.

Parameters, Megatron's ``GroupedMLP`` names: ``weight1 [E_local, h, F]`` (``[E_local, h, 2F]`` for
SwiGLU: gate then up along the last dim), ``weight2 [E_local, F, h]``, ``bias1``, ``bias2``. Dim 0
is split over the ``ep`` axis and every parameter is tagged ``expert`` (its gradient is reduced
over the expert-data-parallel group); each is drawn at its global ``[E, ...]`` shape and sliced, so
expert ``e`` has the same initial value at every ``ep``. Expert tensor parallelism is 1: under
sequence parallelism the experts are replicated over tp and see each tp rank's own tokens, so the
parameters are also tagged ``sequence_parallel`` (gradients summed over tp).

FP8 (``fp8``, an enabled :class:`~core.fp8.FP8Config`): fc1 and fc2 each run as one FP8 grouped
matmul (:func:`core.fp8.fp8_ragged_dot`) over all local experts, with per-tensor scales (one for
the rows, one for all the experts' weights, one for the output gradient); under the delayed recipe
their scales are the ``"fp8_scale"`` collection's ``fc1_scale`` and ``fc2_scale``
(:func:`core.fp8.module_scale`). Biases and the activation stay in high precision. The windows
implementation then runs the two GEMMs separately (:class:`~core.transformer.moe.grouped_gemm.
WindowedGemm`), not the fused per-window MLP: fc2's input scale needs the amax of every row's
activation before any window is quantized.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from core.fp8 import FP8Config, fp8_ragged_dot, module_scale
from core.param_metadata import with_parallel_metadata
from core.tensor_parallel.fast_vjp import gelu
from core.tensor_parallel.layers import default_init_method
from core.tensor_parallel.random import tensor_parallel_init
from core.transformer.moe.grouped_gemm import WindowedGemm, group_ids, windowed_apply

EP_NAMES3 = ("ep", None, None)
EP_NAMES2 = ("ep", None)


class _ExpertMLPBase(nn.Module):
    """Parameters and activation shared by the two expert implementations."""

    num_local_experts: int
    """Experts on this ep rank (``num_experts / ep``)."""
    hidden_size: int
    """Model width ``h``."""
    ffn_hidden_size: int
    """Expert MLP width ``F`` (``--moe-ffn-hidden-size``)."""
    gated_linear_unit: bool = False
    """SwiGLU instead of GELU."""
    bias: bool = True
    """Biases on both linear layers."""
    sequence_parallel: bool = False
    """Tokens are sequence shards of tp ranks: tag the parameters ``sequence_parallel``."""
    init_method: Callable[..., jax.Array] = default_init_method
    """``weight1`` initializer (global shape)."""
    output_layer_init_method: Callable[..., jax.Array] = default_init_method
    """``weight2`` initializer (global shape)."""
    params_dtype: Any = jnp.float32
    """Parameter dtype."""
    fp8: FP8Config | None = None
    """FP8 GEMMs in fc1 and fc2 when enabled (module docstring; None: high precision)."""

    def _params(self) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array | None]:
        e, h, f = self.num_local_experts, self.hidden_size, self.ffn_hidden_size
        f1 = 2 * f if self.gated_linear_unit else f

        def meta(init: Callable[..., jax.Array], names: tuple) -> Callable[..., Any]:
            return with_parallel_metadata(tensor_parallel_init(init, 0, "ep"), names, expert=True,
                                          sequence_parallel=self.sequence_parallel)

        w1 = self.param("weight1", meta(self.init_method, EP_NAMES3), (e, h, f1), self.params_dtype)
        w2 = self.param("weight2", meta(self.output_layer_init_method, EP_NAMES3), (e, f, h), self.params_dtype)
        b1 = b2 = None
        if self.bias:
            b1 = self.param("bias1", meta(nn.initializers.zeros, EP_NAMES2), (e, f1), self.params_dtype)
            b2 = self.param("bias2", meta(nn.initializers.zeros, EP_NAMES2), (e, h), self.params_dtype)
        return w1, b1, w2, b2

    def _activation(self, x: jax.Array) -> jax.Array:
        if self.gated_linear_unit:
            gate, up = jnp.split(x, 2, axis=-1)
            return jax.nn.silu(gate) * up
        return gelu(x)

    @property
    def _fp8_enabled(self) -> bool:
        return self.fp8 is not None and self.fp8.enabled

    def _grouped_mlp(self, rows: jax.Array, gs: jax.Array, params: tuple,
                     dot1: Callable[..., jax.Array], dot2: Callable[..., jax.Array]) -> jax.Array:
        """``fc2(act(fc1(rows)))`` with the grouped GEMMs ``dot(x, w, group_sizes)``."""
        w1, b1, w2, b2 = params
        # Each row's expert bias by a one-hot matmul (zero for padding rows): the gather's backward
        # would scatter-add every row into E bias rows, in bf16, an atomic loop on a GPU.
        one_hot = jax.nn.one_hot(group_ids(gs, rows.shape[0]), self.num_local_experts, dtype=rows.dtype)
        h = dot1(rows, w1, gs)
        if b1 is not None:
            h = h + one_hot @ b1
        y = dot2(self._activation(h), w2, gs)
        if b2 is not None:
            y = y + one_hot @ b2
        return y

    def _fp8_mlp(self, rows: jax.Array, gs: jax.Array, params: tuple, gemm: Any = None) -> jax.Array:
        """The expert MLP with fc1 and fc2 as FP8 grouped matmuls on the ``gemm`` backend."""
        def dot(name: str) -> Callable[..., jax.Array]:
            return functools.partial(fp8_ragged_dot, config=self.fp8, scale=module_scale(self, self.fp8, name),
                                     gemm=gemm)
        return self._grouped_mlp(rows, gs, params, dot("fc1_scale"), dot("fc2_scale"))


def default_grouped_implementation() -> str:
    """``GroupedMLP``'s implementation when none is set: ``"windows"`` when JAX's default backend is
    the CPU, else ``"ragged_dot"``."""
    return "windows" if jax.default_backend() == "cpu" else "ragged_dot"


class GroupedMLP(_ExpertMLPBase):
    """All local experts at once, Megatron's ``--moe-grouped-gemm``: two ``jax.lax.ragged_dot``
    grouped GEMMs, or on the CPU the whole expert MLP over windows of each expert's rows
    (:func:`~core.transformer.moe.grouped_gemm.windowed_apply`)."""

    window: int | None = None
    """Rows per expert of the windows' first pass (:func:`~core.transformer.moe.grouped_gemm.
    default_window` of the expected rows; None: of all ``M`` rows). Only speed depends on it."""
    implementation: str | None = None
    """``"ragged_dot"`` or ``"windows"`` (None: :func:`default_grouped_implementation`)."""

    @nn.compact
    def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """Expert outputs ``[M, h]`` of ``rows [M, h]`` grouped by local expert (``group_sizes [E_local]``)."""
        w1, b1, w2, b2 = (None if p is None else p.astype(rows.dtype) for p in self._params())
        gs = group_sizes.astype(jnp.int32)
        windows = (self.implementation or default_grouped_implementation()) == "windows"
        if self._fp8_enabled:
            return self._fp8_mlp(rows, gs, (w1, b1, w2, b2), WindowedGemm(self.window) if windows else None)
        if windows:
            def mlp(x: jax.Array, p: tuple) -> jax.Array:  # x [windows, window, h], p their experts' weights
                w1, b1, w2, b2 = p
                h = jnp.einsum("cwk,ckf->cwf", x, w1)
                if b1 is not None:
                    h = h + b1[:, None]
                y = jnp.einsum("cwf,cfh->cwh", self._activation(h), w2)
                return y if b2 is None else y + b2[:, None]
            return windowed_apply(rows, (w1, b1, w2, b2), gs, mlp, self.window)
        return self._grouped_mlp(rows, gs, (w1, b1, w2, b2), lax.ragged_dot, lax.ragged_dot)


class SequentialMLP(_ExpertMLPBase):
    """The local experts one after the other (Megatron's ``SequentialMLP``, ``--moe-grouped-gemm``
    off): with static shapes each expert runs on all ``M`` rows and keeps its own group's.

    With FP8 the GEMMs are the FP8 grouped matmul over ``lax.ragged_dot`` instead of the loop: one
    call per GEMM keeps one set of per-tensor scales for all the experts (a scale must feed exactly
    one FP8 matmul call, :mod:`core.fp8.linear`), and the loop's ``E x M`` rows are what XLA:CPU's
    ``ragged_dot`` computes anyway."""

    @nn.compact
    def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """Same contract as :meth:`GroupedMLP.__call__`."""
        w1, b1, w2, b2 = self._params()
        if self._fp8_enabled:
            params = tuple(None if p is None else p.astype(rows.dtype) for p in (w1, b1, w2, b2))
            return self._fp8_mlp(rows, group_sizes.astype(jnp.int32), params)
        gid = group_ids(group_sizes.astype(jnp.int32), rows.shape[0])
        out = jnp.zeros(rows.shape[:-1] + (self.hidden_size,), rows.dtype)
        for e in range(self.num_local_experts):
            h = rows @ w1[e].astype(rows.dtype)
            if b1 is not None:
                h = h + b1[e].astype(h.dtype)
            y = self._activation(h) @ w2[e].astype(rows.dtype)
            if b2 is not None:
                y = y + b2[e].astype(y.dtype)
            out = jnp.where((gid == e)[:, None], y, out)
        return out
