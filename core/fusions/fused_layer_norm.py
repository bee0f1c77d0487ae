"""``FusedLayerNorm``: LayerNorm with a C++ kernel on CPU (Megatron's ``fusions/fused_layer_norm.py``).

XLA's CPU backend runs a LayerNorm and its gradient as several passes over the activations
(row statistics, normalisation, the two row sums of the backward, the column sums for the
scale and bias gradients), much slower than torch's one-pass kernel. ``layer_norm_cpu.cc`` does
one pass per row each way and is called through XLA's FFI, built and cached on first use by
``cpu_kernels.py``; where that is not possible (no compiler, another backend, not float32) the same LayerNorm runs
as plain XLA ops, so results differ only by float rounding.

``FusedRMSNorm`` does the same for flax's ``RMSNorm`` (``x * rsqrt(mean(x^2) + eps) * scale``)
with ``rms_norm_cpu.cc`` (``MCJ_FUSED_RMS_NORM=0`` disables it): its forward and backward take
a fraction of the time of flax's RMSNorm as XLA ops. Measurements of both kernels:
``bench/results/2026-11-cpu-tuning.md`` (fused CPU kernels).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from core.fusions.cpu_kernels import register_kernels

_FORWARD, _BACKWARD = "mcj_layer_norm_forward", "mcj_layer_norm_backward"


def fused_layer_norm_available() -> bool:
    """Whether the C++ kernel is built and registered (CPU backend)."""
    return jax.default_backend() == "cpu" and register_kernels(
        "layer_norm_cpu.cc", ((_FORWARD, "LayerNormForward"), (_BACKWARD, "LayerNormBackward")), "MCJ_FUSED_LAYER_NORM")


def fused_layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm of float32 ``x`` over its last dim with the C++ kernel (``scale``/``bias`` ``[h]``)."""
    return _layer_norm(x, scale, bias, float(eps))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, eps):
    return _forward(x, scale, bias, eps)[0]


def _forward(x, scale, bias, eps):
    rows = x.shape[:-1]
    out = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(rows, jnp.float32),
           jax.ShapeDtypeStruct(rows, jnp.float32))
    return jax.ffi.ffi_call(_FORWARD, out, vmap_method="sequential")(x, scale, bias, eps=np.float32(eps))


def _layer_norm_fwd(x, scale, bias, eps):
    y, mean, rstd = _forward(x, scale, bias, eps)
    return y, (x, scale, mean, rstd)


def _layer_norm_bwd(eps, residuals, dy):
    x, scale, mean, rstd = residuals
    out = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(scale.shape, jnp.float32),
           jax.ShapeDtypeStruct(scale.shape, jnp.float32))
    return jax.ffi.ffi_call(_BACKWARD, out, vmap_method="sequential")(dy, x, scale, mean, rstd)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def _needs_flax(norm: nn.Module, x: jax.Array, mask: jax.Array | None) -> bool:
    """What the kernels of both norms cannot do: other dtypes, a mask, other axes, statistics
    averaged across devices (``axis_name``), no scale."""
    return (x.dtype != jnp.float32 or norm.param_dtype != jnp.float32 or norm.dtype not in (None, jnp.float32)
            or mask is not None or norm.reduction_axes != -1 or norm.feature_axes != -1
            or norm.axis_name is not None or not norm.use_scale)


class FusedLayerNorm(nn.LayerNorm):
    """``flax.linen.LayerNorm`` (same fields and parameters) that runs :func:`fused_layer_norm`
    for float32 inputs normalised over the last dim on CPU, and flax's own code otherwise."""

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalise ``x``."""
        if _needs_flax(self, x, mask) or not self.use_bias or not fused_layer_norm_available():
            return super().__call__(x, mask=mask)
        h = x.shape[-1]
        scale = self.param("scale", self.scale_init, (h,), self.param_dtype)
        bias = self.param("bias", self.bias_init, (h,), self.param_dtype)
        return fused_layer_norm(x, scale, bias, self.epsilon)


_RMS_FORWARD, _RMS_BACKWARD = "mcj_rms_norm_forward", "mcj_rms_norm_backward"


def fused_rms_norm_available() -> bool:
    """Whether the RMSNorm C++ kernel is built and registered (CPU backend; ``MCJ_FUSED_RMS_NORM=0`` disables)."""
    return jax.default_backend() == "cpu" and register_kernels(
        "rms_norm_cpu.cc", ((_RMS_FORWARD, "RMSNormForward"), (_RMS_BACKWARD, "RMSNormBackward")), "MCJ_FUSED_RMS_NORM")


def fused_rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm ``x * rsqrt(mean(x^2) + eps) * scale`` of float32 ``x`` over its last dim with the C++
    kernel (``scale`` ``[h]``); :func:`fused_rms_norm_available` must have returned True (it registers
    the kernel)."""
    return _rms_norm(x, scale, float(eps))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, scale, eps):
    return _rms_forward(x, scale, eps)[0]


def _rms_forward(x, scale, eps):
    out = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32))
    return jax.ffi.ffi_call(_RMS_FORWARD, out, vmap_method="sequential")(x, scale, eps=np.float32(eps))


def _rms_norm_fwd(x, scale, eps):
    y, rstd = _rms_forward(x, scale, eps)
    return y, (x, scale, rstd)


def _rms_norm_bwd(eps, residuals, dy):
    x, scale, rstd = residuals
    out = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(scale.shape, jnp.float32))
    return jax.ffi.ffi_call(_RMS_BACKWARD, out, vmap_method="sequential")(dy, x, scale, rstd)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class FusedRMSNorm(nn.RMSNorm):
    """``flax.linen.RMSNorm`` (same fields and ``scale`` parameter): ``x / sqrt(mean(x^2) + eps) * scale``
    over the last dim, with :func:`fused_rms_norm` for float32 inputs on CPU and flax's own code
    otherwise (other dtypes or axes, a mask, ``axis_name``, ``use_scale=False``, other backends)."""

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalise ``x``."""
        if _needs_flax(self, x, mask) or not fused_rms_norm_available():
            return super().__call__(x, mask=mask)
        scale = self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype)
        return fused_rms_norm(x, scale, self.epsilon)
