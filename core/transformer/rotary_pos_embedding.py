"""Rotary position embedding (RoPE, Megatron's ``RotaryEmbedding``) applied to q and k, with
Llama 3.1's frequency scaling (Megatron's ``--use-rope-scaling``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def inverse_frequencies(base: float, rotary_dim: int) -> jax.Array:
    """``[rotary_dim / 2]`` float32 rotary frequencies ``base^(-2i / rotary_dim)``."""
    return 1.0 / (base ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))


def llama3_scaled_frequencies(inv_freq: jax.Array, factor: float, low_freq_factor: float,
                              high_freq_factor: float, original_max_position_embeddings: int) -> jax.Array:
    """Llama 3.1's rope scaling (HF's ``_compute_llama3_parameters``, Megatron's ``_apply_scaling``):
    frequencies whose wavelength exceeds ``original / low_freq_factor`` are divided by ``factor``,
    those below ``original / high_freq_factor`` kept, and those between interpolated smoothly."""
    original = original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    long_waves = wavelen > original / low_freq_factor
    short_waves = wavelen < original / high_freq_factor
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(long_waves, inv_freq / factor, jnp.where(short_waves, inv_freq, smoothed))


def apply_rotary(x: jax.Array, base: float, layout: str = "bnsd", positions: jax.Array | None = None,
                 rotary_dim: int | None = None, inv_freq: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding on ``[b, heads, s, d]`` (``layout="bnsd"``) or ``[b, s, heads,
    d]`` (``"bsnd"``), rotate-half form: positions ``positions`` (``[b, s]``; default 0..s-1),
    only the first ``rotary_dim`` channels of each head rotated (default all; Megatron's
    ``rotary_percent``, frequencies over the rotated width), the rest passed through.
    ``inv_freq`` (``[rotary_dim / 2]``) replaces :func:`inverse_frequencies` ``(base, rotary_dim)``,
    e.g. by :func:`llama3_scaled_frequencies`."""
    seq_axis = layout.index("s")
    s, d = x.shape[seq_axis], x.shape[-1]
    rot = d if rotary_dim is None else rotary_dim
    if inv_freq is None:
        inv_freq = inverse_frequencies(base, rot)
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
