"""The grouped GEMM of ``GroupedMLP``: ``jax.lax.ragged_dot``, or on the CPU a block-diagonal batched
matmul that computes only each row's own expert.

``grouped_gemm(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]``: rows ``lhs[s_g : s_g + n_g]``
(``s_g`` the sum of the earlier sizes) times ``rhs[g]``; rows past ``sum(group_sizes)`` give zeros.

XLA:CPU lowers ``ragged_dot`` to a masked dense product over every group (``G`` times the FLOPs
and a ``[G, M, N]`` temporary). :func:`blocked_ragged_dot` instead pads every group to a multiple of
``block`` rows, gathers the rows into ``[B, block, K]`` blocks (``B = ceil(M / block) + G``, a static
bound), gathers each block's expert weight into ``[B, K, N]`` and runs one batched matmul, then
gathers each row's output back. Work: ``B x block`` rows instead of ``G x M`` (at most
``M + G x block``). The result and its gradients equal ``ragged_dot``'s up to float rounding (the
same per-row products; autodiff's transposes of the gathers are scatter-adds).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

MIN_BLOCK, MAX_BLOCK = 8, 128
"""The block rows :func:`default_block` picks between."""


def group_ids(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Group of each of ``num_rows`` grouped rows (``len(group_sizes)`` for padding rows)."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(num_rows, dtype=group_sizes.dtype),
                            side="right").astype(jnp.int32)


def default_block(num_rows: int, num_groups: int) -> int:
    """Rows per block: the power of two nearest ``num_rows / (4 num_groups)`` (the groups' padding at
    most ~25% of the rows), within ``[MIN_BLOCK, MAX_BLOCK]``."""
    target = max(1, num_rows // (4 * num_groups))
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << (target.bit_length() - 1)))


def blocked_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, block: int | None = None) -> jax.Array:
    """``ragged_dot(lhs, rhs, group_sizes)`` as a block-diagonal batched matmul (module docstring)."""
    m, k = lhs.shape
    g = rhs.shape[0]
    block = block or default_block(m, g)
    gs = group_sizes.astype(jnp.int32)
    padded = (gs + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    padded_start, start = padded_end - padded, jnp.cumsum(gs) - gs
    num_blocks = -(-m // block) + g  # sum(ceil(n_g / block)) <= ceil(M / block) + G
    first = jnp.arange(num_blocks, dtype=jnp.int32) * block
    expert = jnp.minimum(jnp.searchsorted(padded_end, first, side="right").astype(jnp.int32), g - 1)
    within = first[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :] - padded_start[expert][:, None]
    # Blocks past the last group get the last expert and rows past its size: all zeros.
    source = jnp.where(within < gs[expert][:, None], start[expert][:, None] + within, m)  # row m: zeros
    x = jnp.concatenate([lhs, jnp.zeros((1, k), lhs.dtype)])[source]  # [B, block, K]
    y = jnp.einsum("bik,bkn->bin", x, rhs.astype(lhs.dtype)[expert]).reshape(num_blocks * block, -1)
    gid = group_ids(gs, m)
    row = jnp.arange(m, dtype=jnp.int32)
    safe = jnp.minimum(gid, g - 1)
    position = jnp.minimum(padded_start[safe] + row - start[safe], num_blocks * block - 1)
    return jnp.where((gid < g)[:, None], y[position], 0).astype(lhs.dtype)


def grouped_gemm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``lax.ragged_dot`` on accelerators; :func:`blocked_ragged_dot` when JAX's default backend is the CPU."""
    if jax.default_backend() == "cpu":
        return blocked_ragged_dot(lhs, rhs, group_sizes)
    return lax.ragged_dot(lhs, rhs, group_sizes)
