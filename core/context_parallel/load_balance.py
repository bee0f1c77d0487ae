"""Load-balanced sequence split for causal attention under context parallelism.

With causal attention a plain contiguous split over ``cp`` ranks is unbalanced: rank ``r``'s
queries see ``r + 1`` chunks of keys, so the last rank does ``cp`` times the work of the first.
Megatron / TransformerEngine (``DualChunkSwap``) cut the sequence into ``2 * cp`` chunks and
give rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``: an early and a late chunk, so every rank
sees the same number of key chunks. The reordering is applied to the batch once (tokens,
labels, position ids, loss mask), not per layer; after :func:`reorder_for_cp` a plain
contiguous split of the sequence axis over ``cp`` (``PartitionSpec(..., "cp")``) hands every
rank its two chunks, chunk ``r`` first.

Everything here is pure index math: numpy inputs stay numpy (host-side batch preparation),
other inputs go through ``jax.numpy`` (usable under ``jit``), and :func:`cp_positions` takes a
traced rank (``lax.axis_index("cp")``) inside ``shard_map``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _check_split(seq_len: int, cp: int, load_balanced: bool = True) -> int:
    """The chunk length: ``seq_len / (2 cp)`` when load-balanced, else ``seq_len / cp``."""
    if cp < 1:
        raise ValueError(f"context-parallel size must be >= 1, got {cp}")
    parts = 2 * cp if load_balanced else cp
    if seq_len % parts:
        raise ValueError(f"sequence length {seq_len} does not split into {parts} equal chunks "
                         f"(context-parallel size {cp}, load_balanced={load_balanced})")
    return seq_len // parts


def load_balance_chunk_order(cp: int) -> np.ndarray:
    """The ``2 * cp`` chunk indices in reordered position: ``[0, 2cp-1, 1, 2cp-2, ...]``, i.e. rank
    ``r``'s slots ``2r`` and ``2r + 1`` hold chunks ``r`` and ``2cp - 1 - r``."""
    if cp < 1:
        raise ValueError(f"context-parallel size must be >= 1, got {cp}")
    ranks = np.arange(cp)
    return np.stack([ranks, 2 * cp - 1 - ranks], axis=1).reshape(-1)


def load_balance_permutation(seq_len: int, cp: int) -> np.ndarray:
    """Token indices ``perm`` with ``reordered[i] = original[perm[i]]`` for a sequence of ``seq_len``."""
    chunk = _check_split(seq_len, cp)
    order = load_balance_chunk_order(cp)
    return (order[:, None] * chunk + np.arange(chunk)[None, :]).reshape(-1)


def _permute_chunks(x: Any, cp: int, seq_axis: int, order: np.ndarray) -> Any:
    """``x`` with its sequence axis cut into ``2 cp`` chunks and the chunks taken in ``order``."""
    xp = np if isinstance(x, np.ndarray) else jnp
    seq_axis = seq_axis % x.ndim
    seq_len = x.shape[seq_axis]
    chunk = _check_split(seq_len, cp)
    shape = x.shape
    if xp is jnp and np.array_equal(order, np.arange(2 * cp)):
        return x  # cp 1: nothing moves
    # A reshape to [..., 2cp, chunk, ...] and a gather of whole chunks: no per-token index array.
    chunks = xp.reshape(x, (*shape[:seq_axis], 2 * cp, chunk, *shape[seq_axis + 1:]))
    taken = xp.take(chunks, xp.asarray(order), axis=seq_axis)
    return xp.reshape(taken, shape)


def reorder_for_cp(x: Any, cp: int, *, seq_axis: int = 1) -> Any:
    """Reorder global ``x`` (sequence along ``seq_axis``) into the load-balanced order, so that a
    contiguous split over ``cp`` gives rank ``r`` chunks ``r`` and ``2cp-1-r``. numpy in, numpy out;
    anything else goes through ``jax.numpy``. Raises ``ValueError`` unless ``2 * cp`` divides the
    sequence length."""
    return _permute_chunks(x, cp, seq_axis, load_balance_chunk_order(cp))


def restore_from_cp(x: Any, cp: int, *, seq_axis: int = 1) -> Any:
    """Inverse of :func:`reorder_for_cp`: the load-balanced order back to the original order."""
    return _permute_chunks(x, cp, seq_axis, np.argsort(load_balance_chunk_order(cp)))


def cp_positions(rank: int | jax.Array, seq_len: int, cp: int, *, load_balanced: bool = True) -> Any:
    """Global positions (``[seq_len / cp]`` ints) of context-parallel rank ``rank``'s local tokens,
    in local order: chunks ``rank`` then ``2cp-1-rank`` when load-balanced, else the contiguous
    slice ``rank * seq_len / cp ...``. ``seq_len`` is the *global* sequence length. A Python int rank
    gives a numpy array (host), a traced one (``lax.axis_index``) a ``jax.Array``. For rotary
    position ids and attention masks of the local tokens."""
    chunk = _check_split(seq_len, cp, load_balanced)
    xp = np if isinstance(rank, (int, np.integer)) else jnp
    offsets = xp.arange(chunk)
    if not load_balanced:
        return rank * chunk + offsets
    return xp.concatenate([rank * chunk + offsets, (2 * cp - 1 - rank) * chunk + offsets])
