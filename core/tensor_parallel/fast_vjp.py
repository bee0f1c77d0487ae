"""Hand-written VJPs for the dense layers' hot ops, shaped for XLA's CPU backend.

Autodiff of ``x @ W.T`` and of the tanh GELU is correct but leaves XLA's CPU backend work it
runs slowly (a transposed-operand GEMM for the widening layers, an extra full-size tanh
buffer saved for the backward); these functions compute the same values with VJPs that avoid
it. Measurements: ``bench/results/2026-11-cpu-tuning.md`` (profiled and fixed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``x @ weight.T (+ bias)`` over the last dim of ``x`` (weight ``[out, in]``), as one 2-D matmul.

    Flattening the leading dims first matters on CPU: XLA's weight gradient of a 3-D einsum
    contracts two dims and runs markedly slower than the equivalent 2-D matmul. The bias is
    added here so its gradient reads the same ``[tokens, out]`` output gradient as the matmul's
    (a bias added outside makes XLA copy a transposed gradient twice).
    """
    x2 = x.reshape(-1, x.shape[-1])
    y = _matmul_nt(x2, weight) if bias is None else _matmul_nt_bias(x2, weight, bias)
    return y.reshape(x.shape[:-1] + (weight.shape[0],))


def _nt(x: jax.Array, weight: jax.Array) -> jax.Array:
    return lax.dot_general(x, weight, (((1,), (1,)), ((), ())))


def _matmul_grads(x: jax.Array, weight: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(dx, dW)`` of ``x [t, in] @ weight [out, in]^T`` for the output gradient ``dy [t, out]``."""
    nn_dims = (((1,), (0,)), ((), ()))
    dx = lax.dot_general(dy, weight, nn_dims).astype(x.dtype)
    # dW = dy^T @ x contracts the token dim, the leading dim of both operands. GPU GEMMs take
    # transposed operands at full speed, and so does XLA's CPU backend when the output is not
    # wider than the input (fc2, the output projection: a row-major copy of dy first gains
    # nothing). When it is wider (fc1, the fused QKV) the CPU runs the transposed-LHS product
    # well below the row-major one, so x is copied to row-major first: the weight gradient is
    # faster even with the transpose counted. The barrier keeps XLA from folding dW's transpose
    # back into the dot (or its output layout).
    if jax.default_backend() != "cpu" or dy.shape[1] <= x.shape[1]:
        dw = lax.dot_general(dy, x, (((0,), (0,)), ((), ())))
    else:
        dw = lax.optimization_barrier(lax.dot_general(_row_major_transpose(x), dy, nn_dims)).T
    return dx, dw.astype(weight.dtype)


def _row_major_transpose(a: jax.Array) -> jax.Array:
    """``a.T`` materialised row-major by XLA's plain transpose, not fused with ``a``'s producer.

    Left to itself XLA fuses the producer of ``a`` (a LayerNorm it recomputes, a bias-GELU)
    into the transpose, and a fused transpose is a strided elementwise loop, several times
    slower than the plain transpose. Optimization barriers do not stop that
    (XLA's CPU pipeline turns them into scheduling edges), but a conditional's operand is
    always materialised, so the transpose goes in both branches of a ``cond`` on a predicate
    XLA cannot fold (its value does not matter). The barrier on the result keeps XLA from
    folding the transpose back into the dot.
    """
    if a.size == 0:
        return a.T
    transposed = lax.cond(a[0, 0] == a[0, 0], jnp.transpose, jnp.transpose, a)
    return lax.optimization_barrier(transposed)


@jax.custom_vjp
def _matmul_nt(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``x [t, in] @ weight [out, in]^T`` with :func:`_matmul_grads` as its VJP."""
    return _nt(x, weight)


@jax.custom_vjp
def _matmul_nt_bias(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    """``x @ weight^T + bias`` with :func:`_matmul_grads` as its VJP."""
    return _nt(x, weight) + bias


_matmul_nt.defvjp(lambda x, w: (_nt(x, w), (x, w)), lambda res, dy: _matmul_grads(*res, dy))
_matmul_nt_bias.defvjp(
    lambda x, w, b: (_nt(x, w) + b, (x, w, b)),
    lambda res, dy: (*_matmul_grads(res[0], res[1], dy), jnp.sum(dy, axis=0).astype(res[2].dtype)))


_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """The tanh-approximate GELU (``jax.nn.gelu(x, approximate=True)``, Megatron's ``gelu_impl``)
    with a VJP that saves only ``x`` and recomputes ``tanh`` in the backward: autodiff also
    keeps the ``tanh`` buffer, one more full-size ``[tokens, ffn]`` write and read per layer."""
    return jax.nn.gelu(x, approximate=True)


def _gelu_bwd(x: jax.Array, dy: jax.Array) -> tuple[jax.Array]:
    xf = x.astype(jnp.float32)
    t = jnp.tanh(_SQRT_2_OVER_PI * (xf + _GELU_CUBIC * xf * xf * xf))
    dt = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * xf * xf)
    grad = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * dt
    return ((dy.astype(jnp.float32) * grad).astype(x.dtype),)


gelu.defvjp(lambda x: (gelu(x), x), _gelu_bwd)
