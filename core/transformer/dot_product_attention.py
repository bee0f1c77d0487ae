"""Core attention (Megatron's ``DotProductAttention``): causal softmax attention on q, k, v by
backend, the one function the attention layer calls.

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

Options, all on every backend:

* grouped-query attention: ``k`` and ``v`` may have fewer heads than ``q`` (a divisor of it;
  query head ``i`` reads K/V head ``i // (heads / kv_heads)``). ``jax.nn.dot_product_attention``
  takes them as they are; the CPU paths repeat them to the query heads.
* ``segment_ids`` (``[b, s]``): the document-causal mask (a token attends to earlier-or-same
  positions of its own segment). The C++ kernel has no mask, so CPU runs the blocked loop with
  it; XLA and cuDNN get it as ``mask``.
* ``dropout_keep`` / ``dropout_rate``: dropout on the attention probabilities with the given
  keep-mask ``[b, heads, s, s]``. It needs the probabilities, so it runs plain XLA softmax
  attention (materialising the score matrix) whatever the backend: the slow path, only for
  training with ``attention_dropout > 0``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from core.fusions.fused_attention import fused_attention_available, fused_attention_block, fused_causal_attention
from core.transformer.blocked_attention import blocked_causal_attention

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
                             backend: str | None = None, masked: bool = False) -> str:
    """Which implementation :func:`causal_attention` runs for these inputs (one of
    :data:`IMPLEMENTATIONS`); ``backend`` defaults to JAX's default backend. ``masked``: a
    segment mask comes too (the CPU kernel cannot apply it)."""
    backend = _backend(backend)
    if backend == "cpu":
        if masked:
            return "blocked"
        # The kernel's test reads [..., s, d]: ask it with the sequence where the kernel has it.
        # K and V reach it repeated to the query heads, so they have q's shape there.
        q = _to(jax.ShapeDtypeStruct(q.shape, q.dtype), layout, "bnsd")
        k, v = (jax.ShapeDtypeStruct(q.shape, x.dtype) for x in (k, v))
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


def _repeat_kv(x: jax.Array, heads: int) -> jax.Array:
    """``[b, kv_heads, s, d]`` -> ``[b, heads, s, d]``: K/V head ``j`` serves query heads
    ``j * r .. j * r + r - 1`` (``r = heads / kv_heads``); autodiff sums the copies' grads."""
    return x if x.shape[1] == heads else jnp.repeat(x, heads // x.shape[1], axis=1)


def _segment_mask(segment_ids: jax.Array) -> jax.Array:
    """``[b, 1, s, s]`` True where query and key share a segment (broadcast over heads)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def softmax_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None,
                      dropout_keep: jax.Array | None = None, dropout_rate: float = 0.0) -> jax.Array:
    """Plain XLA causal attention on ``[b, heads, s, d]`` (``k``/``v`` possibly fewer heads) with
    the score matrix materialised: float32 scores and softmax, the optional segment mask, and
    dropout of the probabilities by ``dropout_keep`` (``[b, heads, s, s]``, kept values scaled
    by ``1 / (1 - dropout_rate)``)."""
    heads, s = q.shape[1], q.shape[2]
    k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
    scores = jnp.einsum("bnqd,bnkd->bnqk", q, k, preferred_element_type=jnp.float32) / float(q.shape[-1]) ** 0.5
    allowed = (jnp.arange(s)[:, None] >= jnp.arange(s)[None, :])[None, None]
    if segment_ids is not None:
        allowed = allowed & _segment_mask(segment_ids)
    probs = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    if dropout_keep is not None:
        probs = jnp.where(dropout_keep, probs / (1.0 - dropout_rate), 0.0)
    return jnp.einsum("bnqk,bnkd->bnqd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: str = "bnsd",
                     implementation: str | None = None, *, segment_ids: jax.Array | None = None,
                     dropout_keep: jax.Array | None = None, dropout_rate: float = 0.0) -> jax.Array:
    """Causal softmax attention ``softmax(q k^T / sqrt(d) + mask) v`` in ``layout``; the output
    has ``q``'s shape, layout and dtype. ``implementation`` forces one of
    :data:`IMPLEMENTATIONS` (default: :func:`attention_implementation`). ``k``/``v`` may have
    fewer heads (grouped-query attention); ``segment_ids`` and ``dropout_keep`` are the
    options of the module docstring."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    heads_axis = layout.index("n")
    heads, kv_heads = q.shape[heads_axis], k.shape[heads_axis]
    if kv_heads != v.shape[heads_axis] or heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of the key/value heads {kv_heads}, "
                         f"{v.shape[heads_axis]}")
    if dropout_keep is not None:
        q, k, v = (_to(x, layout, "bnsd") for x in (q, k, v))
        return _to(softmax_attention(q, k, v, segment_ids, dropout_keep, dropout_rate), "bnsd", layout)
    masked = segment_ids is not None
    impl = implementation or attention_implementation(q, k, v, layout, masked=masked)
    if impl in ("cpu_kernel", "blocked"):
        q, k, v = (_to(x, layout, "bnsd") for x in (q, k, v))
        k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
        block = fused_attention_block(q, k, v) if impl == "cpu_kernel" and not masked else None
        out = fused_causal_attention(q, k, v, block) if block else \
            blocked_causal_attention(q, k, v, segment_ids=segment_ids)
        return _to(out, "bnsd", layout)
    if impl not in ("cudnn", "xla"):
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {impl!r}")
    q, k, v = (_to(x, layout, "bsnd") for x in (q, k, v))
    mask = _segment_mask(segment_ids) if masked else None
    if impl == "cudnn":
        try:
            out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="cudnn")
            return _to(out, "bsnd", layout)
        except (NotImplementedError, RuntimeError, ValueError) as err:  # cuDNN refused these inputs
            if "cudnn" not in _warned:
                _warned.add("cudnn")
                warnings.warn(f"cuDNN attention cannot serve {q.dtype} q {q.shape}: {err}; using XLA's", stacklevel=2)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
    return _to(out, "bsnd", layout)
