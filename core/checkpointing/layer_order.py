"""The checkpoint order of the stacked layer arrays: independent of the virtual-pipeline size.

``GPTModel`` stacks its layers ``[vpp, L/vpp, ...]`` (layer ``l`` at ``[l // (L/vpp), l % (L/vpp)]``,
dim 1 split over ``pp``), so the same model has differently shaped arrays at different ``vpp``.
In row-major order that is layer order, so a reshape to ``[1, L, ...]`` (the ``vpp = 1``
stacking) gives one form for every ``vpp``: checkpoints store it, and a load reshapes it back
to the loading run's ``vpp`` (moving layers between pipeline ranks as the new assignment
wants). Applied to the parameters and to every parameter-shaped leaf of the
layout-independent optimizer state.

That is Megatron's interleaved placement (row ``(c, r * n + j)`` is layer ``(c * pp + r) * n + j``).
Under ZB-V's V placement (:data:`~core.pipeline_parallel.utils.V_PLACEMENT`: rank ``r``'s chunk 1
is virtual stage ``2 pp - 1 - r``) chunk 1's ``pp`` row blocks come in reverse rank order: they are
flipped on the way to layer order and back, so a ZB-V checkpoint loads into any layout and any
layout's into ZB-V.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from core.pipeline_parallel.utils import INTERLEAVED_PLACEMENT, V_PLACEMENT


def is_layer_path(path: str) -> bool:
    """Whether a parameter path (``DistributedDataParallel.param_paths``) is a stacked layer array."""
    return path.startswith("['layers']")


def _interleave(x: jax.Array, placement: str, pipeline_size: int) -> jax.Array:
    """``[vpp, pp * n, ...]`` rows of ``placement`` in the interleaved placement's order: under the
    V placement chunk 1's ``pp`` row blocks reversed (its own inverse), else ``x``."""
    if placement == INTERLEAVED_PLACEMENT or x.shape[0] == 1 or pipeline_size == 1:
        return x
    if placement != V_PLACEMENT or x.shape[0] != 2:
        raise ValueError(f"chunk placement {placement!r} with {x.shape[0]} chunks: expected interleaved, or v with 2")
    blocks = x[1].reshape((pipeline_size, -1) + x.shape[2:])
    return jnp.stack([x[0], blocks[::-1].reshape(x.shape[1:])])


def merge_chunks(x: jax.Array, placement: str = INTERLEAVED_PLACEMENT, pipeline_size: int = 1) -> jax.Array:
    """``[vpp, L/vpp, ...]`` stacked in ``placement`` over ``pipeline_size`` ranks -> ``[1, L, ...]``
    in layer order (traceable: for a jitted program, which then names the sharding of the result;
    :func:`to_layer_order` outside one)."""
    x = _interleave(x, placement, pipeline_size)
    return x if x.shape[0] == 1 else x.reshape((1, -1) + x.shape[2:])


def split_chunks(x: jax.Array, vpp: int, placement: str = INTERLEAVED_PLACEMENT, pipeline_size: int = 1) -> jax.Array:
    """Inverse of :func:`merge_chunks` (traceable): ``[1, L, ...]`` -> ``[vpp, L/vpp, ...]``."""
    return _interleave(x.reshape((vpp, -1) + x.shape[2:]), placement, pipeline_size)


def to_layer_order(x: jax.Array, placement: str = INTERLEAVED_PLACEMENT, pipeline_size: int = 1) -> jax.Array:
    """``[vpp, L/vpp, ...]`` -> ``[1, L, ...]``, sharded as before (dim 1 over ``pp``)."""
    if x.shape[0] == 1:
        return x
    sharding = NamedSharding(x.sharding.mesh, x.sharding.spec)
    return jax.jit(lambda a: merge_chunks(a, placement, pipeline_size), out_shardings=sharding)(x)


def layer_order_target(like: jax.Array | jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """The restore target of ``like``'s array in checkpoint order (``[1, L, ...]``, same sharding)."""
    return jax.ShapeDtypeStruct((1, like.shape[0] * like.shape[1]) + tuple(like.shape[2:]), like.dtype,
                                sharding=like.sharding)


def from_layer_order(x: jax.Array, vpp: int, placement: str = INTERLEAVED_PLACEMENT,
                     pipeline_size: int = 1) -> jax.Array:
    """Inverse of :func:`to_layer_order` for ``vpp`` model chunks in ``placement`` over
    ``pipeline_size`` ranks."""
    if vpp == 1:
        return x
    return jax.jit(lambda a: split_chunks(a, vpp, placement, pipeline_size), out_shardings=x.sharding)(x)


def map_layer_leaves(fn: Callable[[Any], Any], state: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """``state`` (``{"params": tree, "opt_state": layout-independent optimizer state}``, the latter
    optional) with ``fn`` applied to every leaf that belongs to a stacked layer array: the
    parameters' and, in the optimizer state, the fp32 masters' and each parameter-shaped list's
    (Adam's moments) entries of those parameters."""
    layer = [is_layer_path(p) for p in paths]

    def over(xs: Sequence[Any]) -> list[Any]:
        return [fn(x) if layer[i] and hasattr(x, "shape") else x for i, x in enumerate(xs)]

    leaves, treedef = jax.tree.flatten(state["params"])
    out = dict(state, params=jax.tree.unflatten(treedef, over(leaves)))
    if "opt_state" in state:
        opt = state["opt_state"]
        is_params = lambda x: isinstance(x, list) and len(x) == len(paths)
        inner = jax.tree.map(lambda x: over(x) if is_params(x) else x, opt["inner"], is_leaf=is_params)
        out["opt_state"] = {**opt, "master": tuple(over(list(opt["master"]))), "inner": inner}
    return out
