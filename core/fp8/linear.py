"""The FP8 linear layer's matmul: ``x @ weight.T`` with its three GEMMs on FP8 operands.

**GEMMs.** Each operand is quantized with a per-tensor scale, ``sat_cast(x * scale)`` (a clip to
the format's range, then the cast), the ``dot_general`` takes the FP8 operands with
``preferred_element_type`` the compute dtype (accumulation is fp32 inside the GEMM), and the
result is multiplied by the operands' inverse scales. This is the pattern XLA:GPU's
``gemm_rewriter`` turns into cuBLASLt FP8 GEMMs (``__cublas$lt$matmul$f8``) on sm_89+; on
other backends the FP8 operands are converted and multiplied as usual, which computes the
same rounding of the operands. The forward (fprop ``X W^T``) uses E4M3 for both operands; the
backward quantizes the output gradient (E5M2 under ``hybrid``) and reuses the forward's FP8
copies of X and W for dgrad ``dY W`` and wgrad ``dY^T X`` (``fp8_wgrad=False``: wgrad in high
precision from the saved unquantized X). Only the FP8 copies are saved for the backward, so
the residuals of an FP8 linear take half the bytes of bf16 ones.

**Scaling state: how amaxes get out.** ``tensorwise`` needs nothing: each GEMM's scales come
from its operands' current amaxes. ``delayed`` quantizes with stored scales (``scale f32[3]``,
slots x, w, dy; :mod:`core.fp8.scaling`) and must report the amaxes it saw, including dY's,
which exists only in the backward. The matmul takes ``scale`` as a differentiable input and
its VJP returns, as the "gradient" of ``scale``, the amaxes ``[amax(x), amax(w), amax(dY)]``
(flax's ``fp8_ops`` uses the same channel; here the cotangent carries amaxes only, and the
update stays in :func:`~core.fp8.scaling.delayed_update`). So the training step differentiates
the loss with respect to the FP8 state's scales as well as the parameters, and gets every
layer's amaxes with no extra outputs threaded through the model, the layer scan, recompute
or the pipeline schedules. Two rules follow for whoever consumes that "gradient":

* cotangents that meet are summed by autodiff, so a scale must feed exactly one FP8 matmul
  call per differentiation (true of a layer's own state, one forward and one backward per
  microbatch; rematerialization re-runs the forward but not the VJP);
* amaxes of several microbatches (or pipeline microbatches) combine with ``jnp.maximum``,
  not with the sum that accumulates parameter gradients; then :func:`~core.fp8.scaling.reduce_amax`
  over the mesh axes and :func:`~core.fp8.scaling.delayed_update` once per step, as TE
  updates once per optimizer step.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from core.fp8.config import DY, NUM_SLOTS, FP8Config, W, X
from core.fp8.scaling import current_scale

_NT = (((1,), (1,)), ((), ()))  # x [t, in] . w [out, in] over in
_NN = (((1,), (0,)), ((), ()))  # dy [t, out] . w [out, in] over out
_TN = (((0,), (0,)), ((), ()))  # dy [t, out] . x [t, in] over t


def fp8_linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *, config: FP8Config,
               scale: jax.Array | None = None) -> jax.Array:
    """``x @ weight.T (+ bias)`` over the last dim of ``x`` (weight ``[out, in]``) with FP8 GEMMs.

    ``scale``: the layer's delayed-scaling scales ``f32[3]`` (slots x, w, dy), required with the
    ``delayed`` recipe and ignored with ``tensorwise``; its gradient is the amaxes the GEMMs saw
    (module docstring). The bias is added in high precision after the GEMM, as TE does outside
    the FP8 output epilogue.
    """
    scale = stored_scale(config, scale, "fp8_linear")
    x2 = x.reshape(-1, x.shape[-1])
    y = _fp8_matmul_nt(config, x2, weight, scale)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.reshape(x.shape[:-1] + (weight.shape[0],))


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``sat_cast(x * scale)`` to the FP8 ``dtype``, computed in fp32 (values beyond the format's
    largest finite value saturate to it, as TE's cast does; NaN stays NaN)."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(dtype)


def amax(x: jax.Array) -> jax.Array:
    """``max(|x|)`` as an fp32 scalar."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def dequantize(out: jax.Array, scale_a: jax.Array, scale_b: jax.Array) -> jax.Array:
    """A GEMM's result on FP8 operands times the operands' inverse scales (TE's scale_inv)."""
    return out * ((1.0 / scale_a) * (1.0 / scale_b)).astype(out.dtype)


def stored_scale(config: FP8Config, scale: jax.Array | None, caller: str) -> jax.Array:
    """``scale`` as an FP8 GEMM takes it: required with the delayed recipe, unit scales (unused)
    under tensorwise; ``caller`` names the function in the errors."""
    if not config.enabled:
        raise ValueError(f"{caller} needs an FP8Config with a format (fp8='e4m3' or 'hybrid')")
    if scale is None:
        if config.delayed:
            raise ValueError("the delayed recipe quantizes with stored scales: pass scale (f32[3])")
        scale = jnp.ones((NUM_SLOTS,), jnp.float32)
    return scale


def _scaled_dot(a: jax.Array, b: jax.Array, dims: Any, scale_a: jax.Array, scale_b: jax.Array,
                out_dtype: Any) -> jax.Array:
    """``dot(a, b)`` of FP8 operands in ``out_dtype``, dequantized."""
    return dequantize(lax.dot_general(a, b, dims, preferred_element_type=out_dtype), scale_a, scale_b)


def _operand_scales(config: FP8Config, scale: jax.Array, amaxes: tuple[jax.Array, ...],
                    slots: tuple[int, ...]) -> list[jax.Array]:
    """The quantization scale of each slot: stored (delayed) or from the current amax (tensorwise)."""
    maxes = config.slot_maxes()
    if config.delayed:
        return [scale[s] for s in slots]
    return [current_scale(a, maxes[s]) for a, s in zip(amaxes, slots)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_matmul_nt(config: FP8Config, x: jax.Array, weight: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [t, in] @ weight [out, in]^T`` with FP8 GEMMs; the VJP's cotangent of ``scale`` is the amaxes."""
    return _fp8_matmul_fwd(config, x, weight, scale)[0]


def _fp8_matmul_fwd(config: FP8Config, x: jax.Array, weight: jax.Array, scale: jax.Array):
    amax_x, amax_w = amax(x), amax(weight)
    sx, sw = _operand_scales(config, scale, (amax_x, amax_w), (X, W))
    xq, wq = quantize(x, sx, config.forward_dtype), quantize(weight, sw, config.forward_dtype)
    out_dtype = jnp.result_type(x.dtype, weight.dtype)
    y = _scaled_dot(xq, wq, _NT, sx, sw, out_dtype)
    # Zero-size arrays carry the operands' dtypes to the backward (residuals must be arrays).
    protos = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), weight.dtype))
    x_saved = xq if config.fp8_wgrad else x
    return y, (x_saved, wq, sx, sw, scale, amax_x, amax_w, protos)


def _fp8_matmul_bwd(config: FP8Config, res, dy: jax.Array):
    x_saved, wq, sx, sw, scale, amax_x, amax_w, (x_proto, w_proto) = res
    amax_dy = amax(dy)
    (sdy,) = _operand_scales(config, scale, (amax_dy,), (DY,))
    dyq = quantize(dy, sdy, config.backward_dtype)
    dx = _scaled_dot(dyq, wq, _NN, sdy, sw, dy.dtype)
    if config.fp8_wgrad:
        dw = _scaled_dot(dyq, x_saved, _TN, sdy, sx, dy.dtype)
    else:
        dw = lax.dot_general(dy, x_saved.astype(dy.dtype), _TN)
    amaxes = jnp.stack([amax_x, amax_w, amax_dy]).astype(scale.dtype)
    return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype), amaxes


_fp8_matmul_nt.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)
