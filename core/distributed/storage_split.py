"""How a checkpoint's copy of one parameter-shaped leaf is split over the data-parallel ranks.

The layout-independent optimizer state (and the params' copy) of a save would otherwise be
whole on every data-parallel rank: with the distributed optimizer, dp times the state's own
shards. :class:`StorageSplit` splits a leaf over the data-parallel axes it is not split over
yet, along one dimension; orbax writes any sharding, so the files do not change.

Its operations run inside ``shard_map``: :meth:`~StorageSplit.cut` and
:meth:`~StorageSplit.join` between a whole leaf and this rank's block, and
:meth:`~StorageSplit.reduce`, which sums per-rank pieces of a leaf straight into the blocks (a
reduce-scatter): the distributed optimizer's bucket shards become the split leaves without any
rank holding a whole bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from core import parallel_state
from core.distributed.collectives import all_gather, all_reduce, group_size, reduce_scatter


def first_unstacked_dim(spec: P) -> int:
    """The first dimension of a parameter split by ``spec`` after its stacked-layer ones (those up to
    the one split over ``"pp"``: ``[vpp, L/vpp, ...]``; 0 for a parameter that is not stacked)."""
    names = [entry if isinstance(entry, tuple) else (entry,) for entry in spec]
    return 1 + max((d for d, entry in enumerate(names) if parallel_state.PP_AXIS in entry), default=-1)


@dataclasses.dataclass(frozen=True)
class StorageSplit:
    """The split of one leaf over data-parallel axes (the default: none, the leaf stays whole)."""

    spec: Any = P()
    """The leaf's partition spec with the split (its own where not split)."""
    dim: int = -1
    """The dimension split over ``axes`` (``-1``: not split)."""
    axes: tuple[str, ...] = ()
    """The mesh axes it is split over, major first."""

    @staticmethod
    def choose(shape: tuple[int, ...], spec: P, state: Any) -> StorageSplit:
        """The split of a leaf of global ``shape`` split by ``spec``: over the data-parallel axes
        (dp, ep, cp) of size > 1 that ``spec`` does not use, along the leaf's last dimension that is
        not split yet and that their size divides, after the one split over pp, if any (stacked
        layers ``[vpp, L/vpp, ...]``: checkpoints reshape those two dimensions between layouts).
        No such dimension: not split."""
        names = [entry if isinstance(entry, tuple) else (entry,) for entry in spec]
        used = {a for entry in names for a in entry if a is not None}
        axes = tuple(a for a in state.data_parallel_with_context_axis_name if a not in used and state.mesh.shape[a] > 1)
        size = int(np.prod([state.mesh.shape[a] for a in axes], dtype=int))
        entries = list(spec) + [None] * (len(shape) - len(spec))
        for dim in reversed(range(first_unstacked_dim(spec), len(shape)) if size > 1 else ()):
            if entries[dim] is None and shape[dim] % size == 0:
                entries[dim] = axes if len(axes) > 1 else axes[0]
                return StorageSplit(P(*entries), dim, axes)
        return StorageSplit(spec)

    def cut(self, x: jax.Array) -> jax.Array:
        """This rank's block of ``x`` (whole on every data-parallel rank)."""
        if self.dim < 0:
            return x
        size = x.shape[self.dim] // group_size(self.axes)
        return lax.dynamic_slice_in_dim(x, lax.axis_index(self.axes) * size, size, self.dim)

    def join(self, x: jax.Array) -> jax.Array:
        """Inverse of :meth:`cut`: the whole leaf from every data-parallel rank's block."""
        return x if self.dim < 0 else all_gather(x, self.axes, axis=self.dim)

    def reduce(self, piece: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        """This rank's block of the sum of ``piece`` over the mesh ``axes``: a reduce-scatter when
        the split's axes are those of ``axes`` that have more than one rank (every case of the
        distributed optimizer), else an all-reduce and :meth:`cut`. Exact when at most one rank
        of ``axes`` holds a non-zero value of each element."""
        if group_size(axes) == 1:
            return self.cut(piece)
        if self._scatters_over(axes):
            return reduce_scatter(piece, self.axes, scatter_dimension=self.dim)
        return self.cut(all_reduce(piece, axes))

    def _scatters_over(self, axes: tuple[str, ...]) -> bool:
        """Whether a sum over ``axes`` lands in this split by one reduce-scatter: the split is
        along a dimension, over exactly those of ``axes`` that have more than one rank."""
        return self.dim >= 0 and self.axes == _wide(axes)


def reduce_pieces(pieces: Sequence[jax.Array], splits: Sequence[StorageSplit], axes: tuple[str, ...]
                  ) -> list[jax.Array]:
    """:meth:`StorageSplit.reduce` of every piece (same dtype) over ``axes``, with one collective
    per kind instead of one per piece: the pieces reduce-scattered along their split dimension go
    as one reduce-scatter of their rows (a piece's rows: its ``size`` blocks, each flattened),
    the others as one all-reduce of them flattened (then cut)."""
    if len(pieces) == 1 or group_size(axes) == 1:
        return [split.reduce(piece, axes) for piece, split in zip(pieces, splits, strict=True)]
    wide = _wide(axes)
    scatter = [k for k, split in enumerate(splits) if split._scatters_over(axes)]
    rest = [k for k in range(len(pieces)) if k not in scatter]
    out: list[Any] = [None] * len(pieces)
    if scatter:
        ranks = group_size(wide)
        rows = [jnp.moveaxis(pieces[k], splits[k].dim, 0).reshape(ranks, -1) for k in scatter]
        summed = reduce_scatter(jnp.concatenate(rows, axis=1), wide, scatter_dimension=0)[0]
        for k, part in zip(scatter, _split(summed, [r.shape[1] for r in rows]), strict=True):
            moved = jnp.moveaxis(pieces[k], splits[k].dim, 0).shape
            out[k] = jnp.moveaxis(part.reshape((moved[0] // ranks, *moved[1:])), 0, splits[k].dim)
    if rest:
        summed = all_reduce(jnp.concatenate([pieces[k].reshape(-1) for k in rest]), axes)
        for k, part in zip(rest, _split(summed, [pieces[k].size for k in rest]), strict=True):
            out[k] = splits[k].cut(part.reshape(pieces[k].shape))
    return out


def _wide(axes: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``axes`` with more than one rank (inside ``shard_map``)."""
    return tuple(a for a in axes if lax.axis_size(a) > 1)


def _split(flat: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    offsets = np.cumsum([0, *sizes])
    return [flat[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
