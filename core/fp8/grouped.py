"""The FP8 grouped matmul of the MoE experts: ``lax.ragged_dot(x, w, group_sizes)`` on FP8 operands.

Same design as :func:`~core.fp8.linear.fp8_linear` (see :mod:`core.fp8.linear`): per-tensor
scales, one for the rows ``x``, one for all the layer's experts' weights ``w [E, in, out]``
together, one for the output gradient (TE's one scaling state per grouped linear); operands
quantized with :func:`~core.fp8.linear.quantize`, the GEMMs take the FP8 operands with
``preferred_element_type`` the compute dtype and the result is multiplied by the inverse scales.
The custom VJP quantizes ``dy`` (E5M2 under ``hybrid``), runs dgrad ``dy w[e]^T`` and wgrad
``x_e^T dy_e`` on the forward's FP8 copies (wgrad in high precision with ``fp8_wgrad=False``)
and returns as the cotangent of ``scale`` the amaxes ``[amax(x), amax(w), amax(dy)]``.
The amaxes of ``x`` and ``dy`` cover the grouped rows only: rows past ``sum(group_sizes)`` are
the dispatcher's padding, which the GEMMs ignore, so they must not set the scales either.

The GEMMs come from a grouped-GEMM backend (:class:`RaggedDotGemm`, the default: ``lax.ragged_dot``
and ``lax.ragged_dot_general``; or the CPU's windows,
:class:`core.transformer.moe.grouped_gemm.WindowedGemm`): an object with ``plan(group_sizes,
num_rows)``, ``dot(lhs, rhs, plan, transpose_rhs=, preferred_element_type=)`` and ``wgrad(lhs,
dy, plan, num_groups, preferred_element_type=)``. XLA:CPU accepts ``float8_e4m3fn`` /
``float8_e5m2`` operands (also mixed) in ``ragged_dot``, ``ragged_dot_general`` and the windows'
batched dots with ``preferred_element_type=float32`` (checked on jax 0.10), so no backend converts
the FP8 operands back before the GEMM. How XLA:GPU lowers an FP8 ``ragged_dot`` (a grouped FP8
GEMM or a dequantizing fallback) has not been checked on a GPU yet.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from core.fp8.config import DY, FP8Config, W, X
from core.fp8.linear import _operand_scales, amax, dequantize, quantize, stored_scale

# dgrad: dy [t, out] . w [E, in, out] over out, w's group dim 0, dy's rows ragged.
_DGRAD = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                       rhs_group_dimensions=[0])
# wgrad: x [t, in] . dy [t, out] over the ragged rows -> [E, in, out].
_WGRAD = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                       rhs_group_dimensions=[])


@dataclasses.dataclass(frozen=True)
class RaggedDotGemm:
    """The grouped GEMMs as ``lax.ragged_dot`` / ``lax.ragged_dot_general`` (accelerators' grouped GEMM)."""

    def plan(self, group_sizes: jax.Array, num_rows: int) -> jax.Array:
        """The group sizes themselves (ragged_dot needs nothing else)."""
        del num_rows
        return group_sizes

    def dot(self, lhs: jax.Array, rhs: jax.Array, plan: jax.Array, *, transpose_rhs: bool = False,
            preferred_element_type: Any = None) -> jax.Array:
        """``ragged_dot(lhs, rhs)``, or with ``transpose_rhs`` ``lhs [t, out]`` times each ``rhs[e]^T``."""
        if transpose_rhs:
            return lax.ragged_dot_general(lhs, rhs, plan, _DGRAD, preferred_element_type=preferred_element_type)
        return lax.ragged_dot(lhs, rhs, plan, preferred_element_type=preferred_element_type)

    def wgrad(self, lhs: jax.Array, dy: jax.Array, plan: jax.Array, num_groups: int, *,
              preferred_element_type: Any = None) -> jax.Array:
        """``[E, in, out]``: each group's rows of ``lhs`` transposed times its rows of ``dy``."""
        del num_groups  # the group sizes' length
        return lax.ragged_dot_general(lhs, dy, plan, _WGRAD, preferred_element_type=preferred_element_type)


def fp8_ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, config: FP8Config,
                   scale: jax.Array | None = None, gemm: Any = None) -> jax.Array:
    """``lax.ragged_dot(x [t, in], w [E, in, out], group_sizes [E]) -> [t, out]`` with FP8 GEMMs.

    Rows ``x[s_e : s_e + n_e]`` (``s_e`` the sum of the earlier sizes) are multiplied by ``w[e]``;
    rows past ``sum(group_sizes)`` give zeros. ``scale``: the delayed recipe's scales ``f32[3]``
    (slots x, w, dy; required with ``delayed``, ignored with ``tensorwise``); its gradient is the
    amaxes the GEMMs saw. ``gemm``: the grouped-GEMM backend (module docstring; None:
    :class:`RaggedDotGemm`); it must be hashable.
    """
    scale = stored_scale(config, scale, "fp8_ragged_dot")
    return _fp8_grouped(config, gemm or RaggedDotGemm(), x, w, group_sizes.astype(jnp.int32), scale)


def _masked_amax(a: jax.Array, num_valid: jax.Array) -> jax.Array:
    """``max(|a|)`` over the first ``num_valid`` rows, fp32."""
    valid = jnp.arange(a.shape[0]) < num_valid
    return jnp.max(jnp.where(valid[:, None], jnp.abs(a), 0)).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_grouped(config: FP8Config, gemm: Any, x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                 scale: jax.Array) -> jax.Array:
    return _fp8_grouped_fwd(config, gemm, x, w, group_sizes, scale)[0]


def _fp8_grouped_fwd(config: FP8Config, gemm: Any, x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                     scale: jax.Array):
    num_valid = jnp.sum(group_sizes)
    amax_x, amax_w = _masked_amax(x, num_valid), amax(w)
    sx, sw = _operand_scales(config, scale, (amax_x, amax_w), (X, W))
    xq, wq = quantize(x, sx, config.forward_dtype), quantize(w, sw, config.forward_dtype)
    out_dtype = jnp.result_type(x.dtype, w.dtype)
    plan = gemm.plan(group_sizes, x.shape[0])
    y = dequantize(gemm.dot(xq, wq, plan, preferred_element_type=out_dtype), sx, sw)
    # Zero-size arrays carry the operands' dtypes to the backward (residuals must be arrays).
    protos = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
    x_saved = xq if config.fp8_wgrad else x
    return y, (x_saved, wq, plan, num_valid, sx, sw, scale, amax_x, amax_w, protos)


def _fp8_grouped_bwd(config: FP8Config, gemm: Any, res, dy: jax.Array):
    x_saved, wq, plan, num_valid, sx, sw, scale, amax_x, amax_w, (x_proto, w_proto) = res
    amax_dy = _masked_amax(dy, num_valid)
    (sdy,) = _operand_scales(config, scale, (amax_dy,), (DY,))
    dyq = quantize(dy, sdy, config.backward_dtype)
    dx = dequantize(gemm.dot(dyq, wq, plan, transpose_rhs=True, preferred_element_type=dy.dtype), sdy, sw)
    if config.fp8_wgrad:
        dw = dequantize(gemm.wgrad(x_saved, dyq, plan, wq.shape[0], preferred_element_type=dy.dtype), sx, sdy)
    else:
        dw = gemm.wgrad(x_saved.astype(dy.dtype), dy, plan, wq.shape[0], preferred_element_type=dy.dtype)
    amaxes = jnp.stack([amax_x, amax_w, amax_dy]).astype(scale.dtype)
    return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype), None, amaxes


_fp8_grouped.defvjp(_fp8_grouped_fwd, _fp8_grouped_bwd)
