"""Causal self-attention by backend: the one function the model calls.

Each backend gets the attention that is fast on it, all with float32 scores and softmax:

* **CPU**: float32 with a sequence and head dim in multiples of 16 runs the C++ flash kernel
  (``core/fusions/fused_attention.py``); everything else the blocked XLA loop
  (``blocked_attention.py``), whose small blocks fit CPU caches.
* **GPU**: bfloat16/float16 runs cuDNN's flash attention through
  ``jax.nn.dot_product_attention(..., implementation="cudnn")``; where cuDNN cannot serve
  (float32, a head dim over its limit or not a multiple of 8, no cuDNN) XLA's implementation
  (``implementation="xla"``: one fused score matrix, float32 logits), never the CPU-sized loop,
  whose thousands of small ops are launch-bound on a GPU.
* Other backends: XLA's implementation.

Layouts: ``"bnsd"`` is ``[batch, heads, seq, head_dim]`` (the CPU paths' layout), ``"bsnd"`` is
``[batch, seq, heads, head_dim]`` (what ``jax.nn.dot_product_attention`` and cuDNN take). The
model asks :func:`preferred_layout` and builds q, k, v in it, so no backend pays a transpose;
any layout works on any backend (a transpose is added where they differ).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from core.fusions.fused_attention import fused_attention_available, fused_attention_block, fused_causal_attention
from core.models.gpt.blocked_attention import blocked_causal_attention

LAYOUTS = ("bnsd", "bsnd")
"""Supported q/k/v layouts (see the module docstring)."""

IMPLEMENTATIONS = ("cpu_kernel", "blocked", "cudnn", "xla")
"""What :func:`attention_implementation` may return."""

_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_DIM = 128  # 256 on Hopper; 128 everywhere since Ampere
_warned: set[str] = set()


def _backend(backend: str | None) -> str:
    return backend or jax.default_backend()


def preferred_layout(backend: str | None = None) -> str:
    """The q/k/v layout the backend's attention reads without a transpose."""
    return "bnsd" if _backend(backend) == "cpu" else "bsnd"


def attention_implementation(q: jax.Array, k: jax.Array, v: jax.Array, layout: str = "bnsd",
                             backend: str | None = None) -> str:
    """Which implementation :func:`causal_attention` runs for these inputs (one of
    :data:`IMPLEMENTATIONS`); ``backend`` defaults to JAX's default backend."""
    backend = _backend(backend)
    if backend == "cpu":
        # The kernel's test reads [..., s, d]: ask it with the sequence where the kernel has it.
        q, k, v = (_to(jax.ShapeDtypeStruct(x.shape, x.dtype), layout, "bnsd") for x in (q, k, v))
        return "cpu_kernel" if fused_attention_block(q, k, v) is not None and fused_attention_available() \
            else "blocked"
    if backend in ("gpu", "cuda") and q.dtype in _CUDNN_DTYPES and q.dtype == k.dtype == v.dtype \
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= _CUDNN_MAX_HEAD_DIM:
        return "cudnn"
    return "xla"


def _to(x, src: str, dst: str):
    """``x`` from layout ``src`` to ``dst`` (the two differ by swapping axes 1 and 2)."""
    if src == dst:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        s = x.shape
        return jax.ShapeDtypeStruct((s[0], s[2], s[1], *s[3:]), x.dtype)
    return jnp.swapaxes(x, 1, 2)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: str = "bnsd",
                     implementation: str | None = None) -> jax.Array:
    """Causal softmax attention ``softmax(q k^T / sqrt(d) + mask) v`` in ``layout``; the output
    has the inputs' shape, layout and dtype. ``implementation`` forces one of
    :data:`IMPLEMENTATIONS` (default: :func:`attention_implementation`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    impl = implementation or attention_implementation(q, k, v, layout)
    if impl in ("cpu_kernel", "blocked"):
        q, k, v = (_to(x, layout, "bnsd") for x in (q, k, v))
        block = fused_attention_block(q, k, v) if impl == "cpu_kernel" else None
        out = fused_causal_attention(q, k, v, block) if block else blocked_causal_attention(q, k, v)
        return _to(out, "bnsd", layout)
    if impl not in ("cudnn", "xla"):
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {impl!r}")
    q, k, v = (_to(x, layout, "bsnd") for x in (q, k, v))
    if impl == "cudnn":
        try:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            return _to(out, "bsnd", layout)
        except (NotImplementedError, RuntimeError, ValueError) as err:  # cuDNN refused these inputs
            if "cudnn" not in _warned:
                _warned.add("cudnn")
                warnings.warn(f"cuDNN attention cannot serve {q.dtype} q {q.shape}: {err}; using XLA's", stacklevel=2)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    return _to(out, "bsnd", layout)
