"""Softmax attention with a C++ kernel on CPU (Megatron's fused attention backends).

XLA's CPU backend runs the blocked attention of ``core/transformer/dot_product_attention.py`` as a
loop of small batched matmuls on one thread, well behind torch's SDPA, which uses every core.
``attention_cpu.cc`` is flash attention for CPU: a (batch, head) pair at a time with its working
set in cache, register-tiled micro-kernels for the matmuls, the probabilities recomputed in the
backward from the saved row log-sum-exp, key blocks above the diagonal skipped, and pairs
spread over XLA's intra-op threads, so it is faster than the XLA loop even on one core
(``bench/results/2026-11-cpu-tuning.md``, fused CPU kernels). It is built and
cached like the other fused kernels (``cpu_kernels.py``); where it is unavailable, or the
inputs are not float32 with a head dim and sequence in multiples of 16, callers use the XLA
path, so results differ only by float rounding.

The kernel also runs without the causal mask (``causal=False``), and its forward and backward
are callable on their own (:func:`fused_attention_forward`, :func:`fused_attention_backward`):
ring attention (``core/context_parallel/ring_attention.py``) computes each of its block
products with them, the backward given the ring's global output and log-sum-exp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from core.fusions.cpu_kernels import register_kernels

_FORWARD, _BACKWARD = "mcj_attention_forward", "mcj_attention_backward"
_LANES = 16  # the kernel's vector width in floats: head_dim and blocks are multiples of it


def fused_attention_available() -> bool:
    """Whether the C++ kernel is built and registered (CPU backend; ``MCJ_FUSED_ATTENTION=0`` disables)."""
    return jax.default_backend() == "cpu" and register_kernels(
        "attention_cpu.cc", ((_FORWARD, "AttentionForward"), (_BACKWARD, "AttentionBackward")), "MCJ_FUSED_ATTENTION")


def fused_attention_block(q: jax.Array, k: jax.Array, v: jax.Array, block_size: int = 64) -> int | None:
    """The query/key block the kernel would use for ``q, k, v`` ``[..., s, d]`` (the largest
    multiple of 16 up to ``block_size`` dividing ``s``), or None when the kernel does not apply
    (not all float32 of one shape, or ``s`` or ``d`` not a multiple of 16)."""
    if q.ndim < 2 or not q.shape == k.shape == v.shape or not q.dtype == k.dtype == v.dtype == jnp.float32:
        return None
    s, d = q.shape[-2:]
    if d % _LANES or s % _LANES:
        return None
    return max(b for b in range(_LANES, max(block_size, _LANES) + 1, _LANES) if s % b == 0)


def _varying_axes(x: jax.Array) -> frozenset[str]:
    """The ``shard_map`` axes ``x`` is typed as varying over (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    axes = getattr(aval, "vma", None)
    if axes is None:  # JAX versions that keep it in the aval's manual axis type
        axes = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return frozenset(axes)


def _typed_like_inputs(outputs: tuple[jax.Array, ...], inputs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """``outputs`` cast to vary over every ``shard_map`` axis some input varies over.

    An FFI call's results carry no varying-axes type, so inside ``shard_map(check_vma=True)``
    they would read as equal on every device, and a ``lax.scan`` carrying them (ring attention's
    dK/dV) fails to type-check. A no-op outside ``shard_map``.
    """
    axes = frozenset().union(*map(_varying_axes, inputs))
    cast = []
    for y in outputs:
        missing = tuple(sorted(axes - _varying_axes(y)))
        cast.append(lax.pcast(y, missing, to="varying") if missing else y)
    return tuple(cast)


def fused_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """Causal attention on float32 ``[..., s, d]`` with the C++ kernel (see :func:`fused_attention_block`)."""
    return _attention(q, k, v, int(block), True)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int, causal: bool = True) -> jax.Array:
    """Softmax attention on float32 ``[..., s, d]`` with the C++ kernel, causal-masked or not
    (see :func:`fused_attention_block`); differentiable."""
    return _attention(q, k, v, int(block), bool(causal))


def fused_attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, block: int, causal: bool = True
                            ) -> tuple[jax.Array, jax.Array]:
    """The kernel's forward: the output ``[..., s, d]`` and the row log-sum-exp of the scaled
    scores ``[..., s]`` (float32), scale ``1 / sqrt(d)``. Not differentiable on its own."""
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32))
    # The kernel treats every leading index as an independent (batch, head) pair, so a vmapped
    # call is the same call with one more leading dim.
    return _typed_like_inputs(jax.ffi.ffi_call(_FORWARD, out, vmap_method="broadcast_all")(
        q, k, v, block=np.int64(block), causal=np.int64(bool(causal))), (q, k, v))


def fused_attention_backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array,
                             d_out: jax.Array, block: int, causal: bool = True
                             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel's backward: ``(dq, dk, dv)`` from the probabilities ``exp(q k^T / sqrt(d) - lse)``
    and ``D = rowsum(d_out * out)``. ``out`` and ``lse`` may be those of a larger attention whose
    keys include these (ring attention's global ones): the result is then these keys' share of
    that attention's gradients (dq a summand, dk/dv these keys' gradients)."""
    grad = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return _typed_like_inputs(jax.ffi.ffi_call(_BACKWARD, (grad, grad, grad), vmap_method="broadcast_all")(
        q, k, v, out, lse, d_out, block=np.int64(block), causal=np.int64(bool(causal))), (q, k, v, out, lse, d_out))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, block, causal):
    return fused_attention_forward(q, k, v, block, causal)[0]


def _attention_fwd(q, k, v, block, causal):
    out, lse = fused_attention_forward(q, k, v, block, causal)
    return out, (q, k, v, out, lse)


def _attention_bwd(block, causal, residuals, d_out):
    return fused_attention_backward(*residuals, d_out, block, causal)


_attention.defvjp(_attention_fwd, _attention_bwd)
