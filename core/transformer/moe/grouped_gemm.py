"""The grouped GEMMs of ``GroupedMLP`` on the CPU: batched matmuls over windows of each group's rows.

A grouped GEMM ``(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]`` multiplies rows
``lhs[s_g : s_g + n_g]`` (``s_g`` the sum of the earlier sizes) by ``rhs[g]``; rows past
``sum(group_sizes)`` give zeros. Accelerators run it as ``jax.lax.ragged_dot``; XLA:CPU lowers
that to a masked dense product over every group (``G`` times the FLOPs and a ``[G, M, N]``
temporary). :func:`windowed_apply` instead cuts every group's rows into windows of ``window``
rows (a static size a little above the mean group, :func:`default_window`) and runs a per-window
computation (``GroupedMLP``'s whole expert MLP, or one GEMM: :func:`windowed_ragged_dot`) as
batched matmuls:

* pass 1: every group's first window, ``[G, window, K] x [G, K, N]``, the weights as they are;
  a routing no more uneven than the window's margin needs nothing else;
* pass 2, run only when a group is longer than its window (``lax.cond``): the groups' further
  windows, fewer than ``M / window``, as one batched matmul with their groups' weights gathered.

Work: ``G x window`` rows, plus about ``M`` when a group overflows; padding rows past the groups
(the all-to-all's worst-case buffer) cost only the final gather. (A scan over small row blocks
pays a fixed cost per block that makes it several times slower than a dense matmul of the same
FLOPs; these batched matmuls run at the dense matmul's speed, see
``bench/results/2026-11-moe-cpu.md``.) A custom VJP keeps the backward lean: rows move into
windows and back with gathers whose transposes are the inverse gathers (XLA:CPU's scatter-add
is an element loop), and pass 2 is recomputed under its own ``lax.cond``
(differentiating through the forward's ``cond`` would fill its residuals and weight gradients
with zeros every step even when pass 2 does not run). Results and gradients equal
``ragged_dot``'s up to float rounding (the same per-row products).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

WINDOW_MARGIN = 1.25
"""Pass 1's window over the mean group size, at most (a longer group costs pass 2, about as much
again)."""
WINDOW_SIGMAS = 4.0
"""...and at most the mean plus this many standard deviations of a balanced routing's group size
(``sqrt(mean)``): 4 sigma overflow one group in ~30000, so large groups get a tighter margin."""
WINDOW_MULTIPLE = 8
"""Windows are whole multiples of this many rows."""


def group_ids(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Group of each of ``num_rows`` grouped rows (``len(group_sizes)`` for padding rows)."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(num_rows, dtype=group_sizes.dtype),
                            side="right").astype(jnp.int32)


def default_window(expected_rows: int, num_groups: int) -> int:
    """Pass 1's rows per group for a mean group of ``expected_rows / num_groups``: ``WINDOW_MARGIN``
    times it or ``WINDOW_SIGMAS`` standard deviations above it, the smaller, rounded up to a
    multiple of ``WINDOW_MULTIPLE`` (a mean of 128 rows -> 160, 512 -> 608, 2048 -> 2232)."""
    mean = expected_rows / max(1, num_groups)
    window = math.ceil(min(WINDOW_MARGIN * mean, mean + WINDOW_SIGMAS * math.sqrt(mean)))
    return max(WINDOW_MULTIPLE, -(-window // WINDOW_MULTIPLE) * WINDOW_MULTIPLE)


def _take_rows(a: jax.Array, index: jax.Array) -> jax.Array:
    """``a`` with a zero row appended, rows taken at ``index`` (``len(a)``: a zero row)."""
    return jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])[index]


def _window_plan(group_sizes: jax.Array, num_rows: int, window: int, num_extra: int):
    """Where every row goes. Window slots: pass 1's ``G x window``, then pass 2's ``num_extra x
    window``. Returns the slot of every row (past the end: none), the source row of every pass-1
    and pass-2 slot (``num_rows``: padding), pass 2's window groups, and whether pass 2 has work."""
    g = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    start = jnp.cumsum(gs) - gs
    extra = jnp.maximum(-(-gs // window) - 1, 0)  # windows of each group past its first
    extra_end = jnp.cumsum(extra)
    extra_start = extra_end - extra
    col = jnp.arange(window, dtype=jnp.int32)
    source1 = jnp.where(col[None, :] < gs[:, None], start[:, None] + col[None, :], num_rows)
    t = jnp.arange(num_extra, dtype=jnp.int32)
    group2 = jnp.minimum(jnp.searchsorted(extra_end, t, side="right").astype(jnp.int32), g - 1)
    first2 = (t - extra_start[group2] + 1) * window  # position of the window's first row in its group
    rows2 = jnp.where(t < extra_end[-1], gs[group2] - first2, 0)
    source2 = jnp.where(col[None, :] < rows2[:, None], start[group2][:, None] + first2[:, None] + col[None, :],
                        num_rows)
    gid = group_ids(gs, num_rows)
    safe = jnp.minimum(gid, g - 1)
    pos = jnp.arange(num_rows, dtype=jnp.int32) - start[safe]
    slot2 = g * window + (extra_start[safe] + pos // window - 1) * window + pos % window
    slot = jnp.where(gid == g, (g + num_extra) * window, jnp.where(pos < window, safe * window + pos, slot2))
    return slot, source1.reshape(-1), source2.reshape(-1), group2, extra_end[-1] > 0


def windowed_apply(lhs: jax.Array, params: Any, group_sizes: jax.Array, body: Callable[[jax.Array, Any], jax.Array],
                   window: int | None = None) -> jax.Array:
    """Row ``i`` of group ``g`` -> row ``i`` of ``body(rows, params of g)``, computed over row windows
    (module docstring); rows past ``sum(group_sizes)`` give zeros.

    ``params``: a pytree of ``[G, ...]`` arrays, slice ``g`` for group ``g``. ``body(x [c, window, K],
    p) -> [c, window, N]`` computes ``c`` windows at once with ``p`` the pytree of their groups'
    slices ``[c, ...]`` (pass 1: ``params`` as they are, window ``j`` of group ``j``); it must treat
    rows independently (padding rows are dropped). ``window``: pass 1's rows per group (None:
    :func:`default_window` of ``M`` rows). Differentiable in ``lhs`` and ``params``: the backward
    reuses pass 1's residuals and recomputes pass 2 (when it ran) rather than storing it."""
    m, _ = lhs.shape
    window = min(m, window or default_window(m, group_sizes.shape[0]))
    num_extra = -(-m // window) - 1  # pass 2's windows: sum_g (ceil(n_g / window) - 1) < M / window
    # Materialised before the gathers: fused into them, XLA:CPU would redo the index arithmetic per element.
    plan = lax.optimization_barrier(_window_plan(group_sizes, m, window, num_extra))
    return _windowed(body, window, num_extra, lhs, params, plan)


def _slots(plan: tuple, num_groups: int, window: int, num_extra: int) -> tuple[jax.Array, jax.Array]:
    """Each row's slot among pass 1's windows and among pass 2's (past the end: none)."""
    slot = plan[0]
    first = num_groups * window
    return jnp.where(slot < first, slot, first), jnp.where(slot >= first, slot - first, num_extra * window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _windowed(body, window, num_extra, lhs, params, plan):
    return _windowed_fwd(body, window, num_extra, lhs, params, plan)[0]


def _windowed_fwd(body, window, num_extra, lhs, params, plan):
    _, source1, source2, group2, overflow = plan
    k, g = lhs.shape[1], source1.shape[0] // window
    slot1, slot2 = _slots(plan, g, window, num_extra)
    y1, vjp1 = jax.vjp(body, _take_rows(lhs, source1).reshape(g, window, k), params)
    n = y1.shape[-1]
    y = _take_rows(y1.reshape(g * window, n), slot1)
    if num_extra:
        def pass2(y: jax.Array) -> jax.Array:
            x2 = _take_rows(lhs, source2).reshape(num_extra, window, k)
            y2 = body(x2, jax.tree.map(lambda p: p[group2], params))
            return y + _take_rows(y2.reshape(num_extra * window, n), slot2)

        y = lax.cond(overflow, pass2, lambda y: y, y)
    return y, (lhs, params, plan, vjp1)


def _windowed_bwd(body, window, num_extra, residuals, dy):
    lhs, params, plan, vjp1 = residuals
    _, source1, source2, group2, overflow = plan
    k, g, n = lhs.shape[1], source1.shape[0] // window, dy.shape[-1]
    slot1, slot2 = _slots(plan, g, window, num_extra)
    # The row gathers are permutations: their transposes are the inverse gathers.
    dx1, dparams = vjp1(_take_rows(dy, source1).reshape(g, window, n))
    dlhs = _take_rows(dx1.reshape(g * window, k), slot1)
    if num_extra:
        def pass2(grads: tuple) -> tuple:
            dlhs, dparams = grads
            x2 = _take_rows(lhs, source2).reshape(num_extra, window, k)
            _, vjp2 = jax.vjp(body, x2, jax.tree.map(lambda p: p[group2], params))
            dx2, dpicked = vjp2(_take_rows(dy, source2).reshape(num_extra, window, n))
            dparams = jax.tree.map(lambda d, dp: d.at[group2].add(dp), dparams, dpicked)
            return dlhs + _take_rows(dx2.reshape(num_extra * window, k), slot2), dparams

        dlhs, dparams = lax.cond(overflow, pass2, lambda grads: grads, (dlhs, dparams))
    return dlhs, dparams, None


_windowed.defvjp(_windowed_fwd, _windowed_bwd)


def windowed_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, window: int | None = None) -> jax.Array:
    """``lax.ragged_dot(lhs, rhs, group_sizes)`` by :func:`windowed_apply`."""
    return windowed_apply(lhs, rhs.astype(lhs.dtype), group_sizes,
                          lambda x, w: jnp.einsum("cwk,ckn->cwn", x, w), window)


@dataclasses.dataclass(frozen=True)
class WindowedGemm:
    """The three GEMMs of a grouped matmul ``lhs [M, K] x rhs [G, K, N]`` by windows, for custom VJPs
    that pick their own operands (the FP8 grouped matmul, :func:`core.fp8.fp8_ragged_dot`): the
    same pass 1 / pass 2 plan as :func:`windowed_apply`, with ``preferred_element_type`` on every
    product so that FP8 operands accumulate in the compute dtype. Not differentiable itself.
    Frozen and hashable (a static argument of a ``custom_vjp``)."""

    window: int | None = None
    """Pass 1's rows per group (None: :func:`default_window` of ``M`` rows)."""

    def _sizes(self, num_rows: int, num_groups: int) -> tuple[int, int]:
        window = min(num_rows, self.window or default_window(num_rows, num_groups))
        return window, -(-num_rows // window) - 1

    def plan(self, group_sizes: jax.Array, num_rows: int) -> tuple:
        """Where every row goes (computed once, reused by the forward and both backward GEMMs)."""
        window, num_extra = self._sizes(num_rows, group_sizes.shape[0])
        return lax.optimization_barrier(_window_plan(group_sizes, num_rows, window, num_extra))

    def _rows(self, a: jax.Array, plan: tuple, num_groups: int, window: int, num_extra: int):
        """``a``'s rows as pass 1's ``[G, window, .]`` and pass 2's ``[num_extra, window, .]`` windows."""
        _, source1, source2, _, _ = plan
        first = _take_rows(a, source1).reshape(num_groups, window, a.shape[1])
        return first, lambda: _take_rows(a, source2).reshape(num_extra, window, a.shape[1])

    def dot(self, lhs: jax.Array, rhs: jax.Array, plan: tuple, *, transpose_rhs: bool = False,
            preferred_element_type: Any = None) -> jax.Array:
        """``lax.ragged_dot(lhs, rhs, group_sizes)`` with ``rhs [G, K, N]``, or with ``transpose_rhs``
        ``lhs [M, N]`` times each ``rhs[g]`` transposed (the dgrad); rows past the groups give zeros."""
        m, g = lhs.shape[0], rhs.shape[0]
        window, num_extra = self._sizes(m, g)
        _, _, _, group2, overflow = plan
        slot1, slot2 = _slots(plan, g, window, num_extra)
        spec = "cwk,cnk->cwn" if transpose_rhs else "cwk,ckn->cwn"
        x1, x2 = self._rows(lhs, plan, g, window, num_extra)
        y1 = jnp.einsum(spec, x1, rhs, preferred_element_type=preferred_element_type)
        n = y1.shape[-1]
        y = _take_rows(y1.reshape(g * window, n), slot1)
        if num_extra:
            def pass2(y: jax.Array) -> jax.Array:
                y2 = jnp.einsum(spec, x2(), rhs[group2], preferred_element_type=preferred_element_type)
                return y + _take_rows(y2.reshape(num_extra * window, n), slot2)

            y = lax.cond(overflow, pass2, lambda y: y, y)
        return y

    def wgrad(self, lhs: jax.Array, dy: jax.Array, plan: tuple, num_groups: int, *,
              preferred_element_type: Any = None) -> jax.Array:
        """``[G, K, N]``: group ``g``'s rows of ``lhs [M, K]`` transposed times its rows of ``dy [M, N]``
        (the weight gradient of :meth:`dot`); padding rows add nothing."""
        m = lhs.shape[0]
        window, num_extra = self._sizes(m, num_groups)
        _, _, _, group2, overflow = plan
        x1, x2 = self._rows(lhs, plan, num_groups, window, num_extra)
        d1, d2 = self._rows(dy, plan, num_groups, window, num_extra)
        dw = jnp.einsum("cwk,cwn->ckn", x1, d1, preferred_element_type=preferred_element_type)
        if num_extra:
            def pass2(dw: jax.Array) -> jax.Array:
                extra = jnp.einsum("cwk,cwn->ckn", x2(), d2(), preferred_element_type=preferred_element_type)
                return dw.at[group2].add(extra.astype(dw.dtype))

            dw = lax.cond(overflow, pass2, lambda dw: dw, dw)
        return dw
