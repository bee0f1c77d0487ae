"""Rotary position embedding (RoPE, Megatron's ``RotaryEmbedding``) applied to q and k."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rotary(x: jax.Array, base: float, layout: str = "bnsd", positions: jax.Array | None = None,
                 rotary_dim: int | None = None) -> jax.Array:
    """Rotary position embedding on ``[b, heads, s, d]`` (``layout="bnsd"``) or ``[b, s, heads,
    d]`` (``"bsnd"``), rotate-half form: positions ``positions`` (``[b, s]``; default 0..s-1),
    only the first ``rotary_dim`` channels of each head rotated (default all; Megatron's
    ``rotary_percent``, frequencies over the rotated width), the rest passed through."""
    seq_axis = layout.index("s")
    s, d = x.shape[seq_axis], x.shape[-1]
    rot = d if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (base ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    if positions is None:
        angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None, :]
        if seq_axis == 1:  # [s, d] -> [s, 1, d], broadcast over the heads that follow the sequence
            angles = angles[:, None, :]
    else:  # [b, s, d/2] -> [b, 1, s, d/2] (bnsd) or [b, s, 1, d/2] (bsnd)
        angles = positions.astype(jnp.float32)[..., None] * inv_freq
        angles = angles[:, None] if seq_axis == 2 else angles[:, :, None]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)
    xr = x if rot == d else x[..., :rot]
    x1, x2 = jnp.split(xr.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = xr.astype(jnp.float32) * cos + rotated * sin
    if rot != d:
        out = jnp.concatenate([out, x[..., rot:].astype(jnp.float32)], axis=-1)
    return out.astype(x.dtype)
