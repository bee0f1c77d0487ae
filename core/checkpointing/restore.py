"""Restoring a checkpoint into any sharding of the same global shapes.

Restores go straight into the requested shardings, so a checkpoint written with one mesh
layout can be read into any other. Shapes and the tree structure are checked against the saved
metadata first so that a mismatch is a clear ``ValueError`` rather than an orbax traceback.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from core.checkpointing.coordination import barrier, unique_key
from core.checkpointing.files import STATE_ITEM, _require_step, _step_dir, load_metadata

# ---------------------------------------------------------------------------------------
# Restoring
# ---------------------------------------------------------------------------------------


def _key_name(key: Any) -> str:
    """One path element as orbax names it (namedtuple fields and sequence indices included)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _is_meta_leaf(x: Any) -> bool:
    # Orbax's metadata objects are not pytree nodes; None stays an empty node like in the target.
    return x is not None and not isinstance(x, (dict, list, tuple))


def _flatten(tree: Any, is_leaf: Any = None) -> dict[tuple[str, ...], Any]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {tuple(_key_name(k) for k in path): leaf for path, leaf in leaves}


def _fmt(path: Sequence[str]) -> str:
    return "/".join(path) or "<root>"


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(getattr(x, "shape", np.shape(x)))


def check_against_saved(target: Any, saved_tree: Any, partial: bool = False) -> None:
    """Raise ``ValueError`` naming the first path whose presence or global shape differs.

    With ``partial`` the target may omit saved entries (restore a subtree, e.g. params only)."""
    want = _flatten(target)
    have = _flatten(saved_tree, is_leaf=_is_meta_leaf)
    for path, leaf in want.items():
        if path not in have:
            raise ValueError(f"checkpoint has no entry {_fmt(path)!r} (target shape {_shape(leaf)})")
        if _shape(leaf) != _shape(have[path]):
            raise ValueError(
                f"shape mismatch at {_fmt(path)!r}: checkpoint {_shape(have[path])}, target {_shape(leaf)}"
            )
    extra = [p for p in have if p not in want]
    if extra and not partial:
        raise ValueError(
            f"target has no entry {_fmt(extra[0])!r} (checkpoint shape {_shape(have[extra[0]])}); "
            f"{len(extra)} saved entries are missing from the target"
        )


def saved_tree(directory: str | os.PathLike, step: int) -> Any:
    """The saved pytree's metadata of checkpoint ``step`` (a nested dict whose leaves carry
    ``.shape`` and ``.dtype``), read without restoring anything."""
    path = epath.Path(_step_dir(os.path.abspath(directory), step)) / STATE_ITEM
    return ocp.StandardCheckpointHandler().metadata(path).tree


def _abstract(leaf: Any) -> Any:
    """Restore target for one leaf: jax arrays become ShapeDtypeStructs with their sharding."""
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
        # Without a sharding orbax falls back to the saved one, which may name another mesh.
        raise ValueError(f"restore target {leaf} has no sharding; set ShapeDtypeStruct(..., sharding=...)")
    return leaf


def restore_checkpoint(directory: str | os.PathLike, step: int | None, target: Any,
                       partial: bool = False) -> tuple[Any, dict]:
    """Restore ``step`` (latest complete one when None) into ``target``; return ``(state, metadata)``.

    ``target`` mirrors the saved pytree: ``jax.ShapeDtypeStruct`` leaves with ``.sharding`` set
    (or concrete arrays, whose shape, dtype and sharding are used), numpy arrays and python
    scalars for host values. Arrays are read directly into the target shardings, which may
    differ from the ones used at save time. Collective: every process must call it.
    Raises ``FileNotFoundError`` when there is no such checkpoint and ``ValueError`` when the
    tree structure or a global shape differs from the saved one. With ``partial`` the target may
    name a subset of the saved entries (e.g. ``{"params": ...}`` without the optimizer state).
    """
    directory = os.path.abspath(directory)
    step = _require_step(directory, step)
    abstract = jax.tree.map(_abstract, target)
    path = epath.Path(_step_dir(directory, step)) / STATE_ITEM
    check_against_saved(abstract, ocp.StandardCheckpointHandler().metadata(path).tree, partial)
    if partial:  # StandardRestore cannot leave saved entries out; the PyTree handler reads the same files
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        state = ocp.PyTreeCheckpointHandler().restore(path, args=ocp.args.PyTreeRestore(
            abstract, restore_args=restore_args, partial_restore=True))
    else:  # the handler itself, not a CheckpointManager: a read-only manager logs a warning on every load
        state = ocp.StandardCheckpointHandler().restore(path, args=ocp.args.StandardRestore(abstract))
    jax.block_until_ready(state)
    # Every process has read its shards before any returns (as a CheckpointManager's restore
    # ends): nothing a process does next, such as a save's cleanup, can touch the files
    # another one is still reading.
    barrier(unique_key("restored"))
    return state, load_metadata(directory, step)
