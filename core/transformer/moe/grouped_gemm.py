"""The grouped GEMM of ``GroupedMLP``: ``jax.lax.ragged_dot``, or on the CPU a loop over row blocks
that computes only each row's own expert.

``grouped_gemm(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]``: rows ``lhs[s_g : s_g + n_g]``
(``s_g`` the sum of the earlier sizes) times ``rhs[g]``; rows past ``sum(group_sizes)`` give zeros.

XLA:CPU lowers ``ragged_dot`` to a masked dense product over every group (``G`` times the FLOPs
and a ``[G, M, N]`` temporary). :func:`blocked_ragged_dot` instead pads every group to a multiple of
``block`` rows and gathers the rows into ``[B, block, K]`` blocks (``B = ceil(M / block) + G``, a
static bound), then scans over the blocks: a block that holds rows multiplies them by its expert's
weight (read in place, not gathered into a ``[B, K, N]`` copy), an unused block (past the last
group, the static bound's slack) is skipped by ``lax.cond``; each row's output is gathered back.
Work: the used blocks' rows, at most ``M + G x (block - 1)``. The row gathers are permutations, so
their transposes are gathers too (a custom VJP; XLA:CPU's scatter-add is an element loop), and the
scan's transpose adds each block's weight gradient into its expert's slice in place. The result
and its gradients equal ``ragged_dot``'s up to float rounding (the same per-row products).
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
    """Rows per block: the largest power of two within the mean group size ``num_rows / num_groups``
    (padding each group to whole blocks then adds at most about as many rows as it holds), within
    ``[MIN_BLOCK, MAX_BLOCK]`` (measured on the CPU: fewer, larger blocks run faster)."""
    target = max(1, num_rows // max(1, num_groups))
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << (target.bit_length() - 1)))


@jax.custom_vjp
def _take_rows(a: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """``a`` with a zero row appended, rows taken at ``index`` (``len(a)``: a zero row). ``inverse``:
    for each row of ``a`` the one output row it went to (``len(index)``: none), so the transpose
    is the same kind of gather."""
    return jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])[index]


def _take_rows_fwd(a, index, inverse):
    return _take_rows(a, index, inverse), (index, inverse)


def _take_rows_bwd(residuals, g):
    index, inverse = residuals
    return _take_rows(g, inverse, index), None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _block_plan(group_sizes: jax.Array, num_rows: int, num_groups: int, block: int):
    """Where every row goes: the blocks' experts and whether each holds rows, the source row of
    every block slot (``num_rows``: padding), and the block slot of every row (past the end: none)."""
    gs = group_sizes.astype(jnp.int32)
    padded = (gs + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    padded_start, start = padded_end - padded, jnp.cumsum(gs) - gs
    num_blocks = -(-num_rows // block) + num_groups  # sum(ceil(n_g / block)) <= ceil(M / block) + G
    first = jnp.arange(num_blocks, dtype=jnp.int32) * block
    expert = jnp.minimum(jnp.searchsorted(padded_end, first, side="right").astype(jnp.int32), num_groups - 1)
    used = first < padded_end[-1]
    within = first[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :] - padded_start[expert][:, None]
    source = jnp.where(within < gs[expert][:, None], start[expert][:, None] + within, num_rows).reshape(-1)
    gid = group_ids(gs, num_rows)
    safe = jnp.minimum(gid, num_groups - 1)
    slot = jnp.where(gid < num_groups, padded_start[safe] + jnp.arange(num_rows, dtype=jnp.int32) - start[safe],
                     num_blocks * block)
    return num_blocks, expert, used, source, slot


def blocked_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, block: int | None = None) -> jax.Array:
    """``ragged_dot(lhs, rhs, group_sizes)`` as a loop over row blocks (module docstring)."""
    m, k = lhs.shape
    g, n = rhs.shape[0], rhs.shape[-1]
    block = block or default_block(m, g)
    num_blocks, expert, used, source, slot = _block_plan(group_sizes, m, g, block)
    x = _take_rows(lhs, source, slot).reshape(num_blocks, block, k)
    w = rhs.astype(lhs.dtype)

    def product(_, xs):
        rows, e, u = xs
        return None, lax.cond(u, lambda: rows @ lax.dynamic_index_in_dim(w, e, 0, keepdims=False),
                              lambda: jnp.zeros((block, n), lhs.dtype))

    _, y = lax.scan(product, None, (x, expert, used))
    return _take_rows(y.reshape(num_blocks * block, n), slot, source)


def grouped_gemm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``lax.ragged_dot`` on accelerators; :func:`blocked_ragged_dot` when JAX's default backend is the CPU."""
    if jax.default_backend() == "cpu":
        return blocked_ragged_dot(lhs, rhs, group_sizes)
    return lax.ragged_dot(lhs, rhs, group_sizes)
