"""Parameters-only checkpoints written and read one array at a time, by one process.

The model converters (``tools/checkpoint/convert.py``) move whole models between this package's
checkpoints and other formats on the host. Holding every array at once would need the model's
size in memory; here a checkpoint is written with orbax's partial saves (each call adds arrays
to the step being written, :func:`write_params_checkpoint`) and read back array by array
(:func:`read_params_array`), so the host holds about one array at a time.

They run in one process that is not part of a multi-process JAX job (orbax's writes would
wait for the other processes): the converters run as a tool of their own.

The step written is an ordinary checkpoint of :mod:`core.checkpointing.files`' format (state,
metadata, integrity record, commit marker, renamed into place when complete): a training run
loads it as it loads its own. A failure or a signal leaves only a temporary directory, which
the next save into that directory removes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp_v1
from etils import epath
from orbax.checkpoint.experimental.v1 import partial as partial_save

from core.checkpointing import orbax_failure_noise
from core.checkpointing.files import (
    COMMIT_MARKER,
    META_ITEM,
    STATE_ITEM,
    _require_step,
    _step_dir,
    _write_integrity,
    complete_steps,
)
from core.checkpointing.step_writer import _TMP_INFIX

ParamPath = tuple[str, ...]
"""A parameter's keys from the tree's root, e.g. ``("layers", "mlp", "fc1", "weight")``."""


def _nested(path: ParamPath, value: Any) -> dict:
    """``{"a": {"b": value}}`` for ``("a", "b")``."""
    for key in reversed(path):
        value = {key: value}
    return value


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere):
    tensorstore's freed write buffers would otherwise stay in the process, on top of the next
    array's."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """Orbax's absl warnings off (merging per-process OCDBT indexes that a single-process, non-OCDBT
    write does not have is reported once per array)."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _streaming_context() -> ocp_v1.Context:
    """Orbax's options for one process writing host arrays that are not touched while written: no defensive
    copy of each array (it would double the peak); one zarr array per parameter with
    tensorstore chunks of 32 MiB, at most 128 MiB of them in flight (an OCDBT write buffers
    the whole array once more: 2x its size at the peak); no compression (as the trainer's
    checkpoints). Orbax reads this format as it reads the trainer's."""
    context = ocp_v1.Context()
    context.memory.deepcopy_host_arrays = False
    context.memory.write_concurrent_bytes = 128 * 2**20
    context.array.saving.use_ocdbt = False
    context.array.saving.use_compression = False
    context.array.saving.storage_options.chunk_byte_size = 32 * 2**20
    return context


def write_params_checkpoint(directory: str | os.PathLike, arrays: Iterable[tuple[ParamPath, np.ndarray]],
                            metadata: dict, step: int = 0) -> str:
    """Write checkpoint ``step`` of ``directory`` holding ``{"params": tree}``, the tree given
    as ``(path, array)`` pairs produced one at a time (each written before the next is asked
    for), and ``metadata``; returns the step directory. Refuses (``FileExistsError``) a directory
    that already holds checkpoints: a conversion never replaces or rotates a run's checkpoints."""
    directory = os.path.abspath(os.fspath(directory))
    existing = complete_steps(directory)
    if existing:
        raise FileExistsError(f"{directory} already holds checkpoints (steps {existing}): write into a new or "
                              "empty directory")
    os.makedirs(directory, exist_ok=True)
    orbax_failure_noise.silence()
    tmp = os.path.join(directory, f"{step}{_TMP_INFIX}{uuid.uuid4().hex[:8]}")
    try:
        with _streaming_context(), _quiet_absl():
            for path, array in arrays:
                partial_save.save(tmp, {"params": _nested(path, np.asarray(array))})
                del array  # before the next one is built
                release_free_memory()
            partial_save.finalize(tmp)
        # Orbax's own commit marker and records: the commit marker is written last, below.
        for name in (COMMIT_MARKER, "_CHECKPOINT_METADATA", "orbax.checkpoint"):
            if os.path.isfile(os.path.join(tmp, name)):
                os.remove(os.path.join(tmp, name))
        os.makedirs(os.path.join(tmp, META_ITEM))
        ocp.JsonCheckpointHandler().save(epath.Path(tmp) / META_ITEM, args=ocp.args.JsonSave(metadata))
        _write_integrity(tmp)
        with open(os.path.join(tmp, COMMIT_MARKER), "w") as f:
            f.write(f"checkpoint step {step} committed")
        os.rename(tmp, _step_dir(directory, step))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _step_dir(directory, step)


def saved_param_shapes(directory: str | os.PathLike, step: int | None = None) -> dict[ParamPath, tuple]:
    """``{path: (shape, dtype)}`` of every parameter array of a checkpoint (read from orbax's
    metadata, no array read)."""
    step = _require_step(os.path.abspath(os.fspath(directory)), step)
    path = epath.Path(_step_dir(os.path.abspath(os.fspath(directory)), step)) / STATE_ITEM
    tree = ocp.StandardCheckpointHandler().metadata(path).tree["params"]
    out: dict[ParamPath, tuple] = {}

    def walk(node: Any, prefix: ParamPath) -> None:
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, prefix + (key,))
        else:
            out[prefix] = (tuple(node.shape), np.dtype(node.dtype))

    walk(tree, ())
    return out


def read_params_array(directory: str | os.PathLike, path: ParamPath, step: int | None = None,
                      dtype: Any = None) -> np.ndarray:
    """One parameter array of a checkpoint, read alone into host memory; ``dtype``: cast while
    reading (a bf16 copy of an fp32 array never holds the fp32 array whole)."""
    directory = os.path.abspath(os.fspath(directory))
    step = _require_step(directory, step)
    item = epath.Path(_step_dir(directory, step)) / STATE_ITEM
    target = {"params": _nested(path, np.zeros((), np.float32))}
    restore_args = {"params": _nested(path, ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype))}
    # Reads bounded to 128 MiB in flight: the array itself is the only large allocation.
    restored = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=0.125).restore(item, args=ocp.args.PyTreeRestore(
        target, restore_args=restore_args, partial_restore=True))
    node = restored["params"]
    for key in path:
        node = node[key]
    release_free_memory()
    return np.asarray(node)


def read_params_arrays(directory: str | os.PathLike, paths: Sequence[ParamPath], step: int | None = None,
                       dtype: Any = None) -> Iterable[tuple[ParamPath, np.ndarray]]:
    """:func:`read_params_array` for each of ``paths`` in turn (one array in memory at a time)."""
    for path in paths:
        yield path, read_params_array(directory, path, step, dtype)


__all__ = ["ParamPath", "read_params_array", "read_params_arrays", "saved_param_shapes", "write_params_checkpoint"]
