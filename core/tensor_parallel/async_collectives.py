"""Ring collectives on ``lax.ppermute`` (the xlstm_jax API), for overlapping communication with
compute: each step moves one chunk to a ring neighbour, so a consumer can start on the chunks
already received.

Conventions (same as xlstm_jax): gathers return a list whose entry ``i`` is the value of the
device ``i`` steps behind in the ring direction (``shift_up``: device ``me - i``); scatters
take a list of per-step partial results and return this device's summed chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

PyTree = Any


def _shift(n: int, up: bool) -> list[tuple[int, int]]:
    return [(j, (j + 1) % n) if up else (j, (j - 1) % n) for j in range(n)]


def async_gather(x: PyTree, axis_name: str, shift_up: bool = True) -> list[PyTree]:
    """All-gather by ``n - 1`` ring steps; entry ``i`` comes from device ``me -/+ i``."""
    n = lax.axis_size(axis_name)
    perm = _shift(n, shift_up)
    out, p = [x], x
    for _ in range(1, n):
        p = lax.ppermute(p, axis_name, perm)
        out.append(p)
    return out


def async_gather_bidirectional(x: jax.Array, axis_name: str, shift_up: bool = True) -> list[jax.Array]:
    """All-gather sending both ways round the ring (half the steps); same order as :func:`async_gather`."""
    n = lax.axis_size(axis_name)
    up, down = [], []
    p_up = p_down = x
    for i in range(1, n):
        if i % 2:
            p_up = lax.ppermute(p_up, axis_name, _shift(n, True))
            up.append(p_up)
        else:
            p_down = lax.ppermute(p_down, axis_name, _shift(n, False))
            down.append(p_down)
    return [x] + up + down[::-1] if shift_up else [x] + down + up[::-1]


def async_gather_split(x: jax.Array, axis_name: str) -> list[jax.Array]:
    """Split the features in two halves and gather one up and one down the ring (2n entries)."""
    first, second = jax.tree.map(lambda v: jnp.split(v, 2, axis=-1), x)
    return async_gather(first, axis_name, shift_up=True) + async_gather(second, axis_name, shift_up=False)


def _check_len(xs: Sequence[Any], n: int, axis_name: str) -> None:
    if len(xs) != n:
        raise ValueError(f"need one partial result per device of axis {axis_name!r} ({n}), got {len(xs)}")


def async_scatter(xs: Sequence[PyTree], axis_name: str, shift_up: bool = True) -> PyTree:
    """Scatter-sum by ring steps: device ``d`` ends with ``sum_k xs[k]`` of device ``d -/+ (n-1-k)``."""
    n = lax.axis_size(axis_name)
    _check_len(xs, n, axis_name)
    perm = _shift(n, shift_up)
    y = xs[0]
    for x in xs[1:]:
        y = jax.tree.map(jnp.add, lax.ppermute(y, axis_name, perm), x)
    return y


def async_scatter_split(xs: Sequence[PyTree], axis_name: str) -> PyTree:
    """Scatter-sum with the features split in halves travelling opposite ways round the ring."""
    n = lax.axis_size(axis_name)
    _check_len(xs, n, axis_name)
    half = lambda v, k: v[..., : v.shape[-1] // 2] if k == 0 else v[..., v.shape[-1] // 2:]
    y_up = jax.tree.map(lambda v: half(v, 0), xs[0])
    y_down = jax.tree.map(lambda v: half(v, 1), xs[0])
    for x in xs[1:]:
        y_up = jax.tree.map(jnp.add, lax.ppermute(y_up, axis_name, _shift(n, True)),
                            jax.tree.map(lambda v: half(v, 0), x))
        y_down = jax.tree.map(jnp.add, lax.ppermute(y_down, axis_name, _shift(n, False)),
                              jax.tree.map(lambda v: half(v, 1), x))
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=-1), y_up, y_down)
