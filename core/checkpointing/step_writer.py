"""Writing and committing one checkpoint step, every process together (the body of a save; run
in the background by :mod:`core.checkpointing.saver` for asynchronous saves).

Every process writes its shards into ``<step>.orbax-checkpoint-tmp-<n>``; once all have, process
0 merges the per-process indexes, writes ``integrity.json`` and the commit marker into it and only
then renames it to ``<step>``, so a half-written step is never reported as the latest checkpoint
nor counted by the ``max_to_keep`` retention. Barriers use the ``jax.distributed`` coordination
service, never a device collective.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from core.checkpointing import orbax_failure_noise
from core.checkpointing.coordination import COORDINATION_TIMEOUT_MS, barrier, call_key, unique_key
from core.checkpointing.files import (
    COMMIT_MARKER,
    META_ITEM,
    STATE_ITEM,
    _incomplete_step_dirs,
    _step_dir,
    _write_integrity,
    complete_steps,
)

logger = logging.getLogger(__name__)

_TMP_INFIX = ".orbax-checkpoint-tmp-"  # orbax's name for a step being written: its leftovers match too


def _leftover_tmp_dirs(directory: str) -> list[str]:
    """Directories of saves that never committed (``<step>.orbax-checkpoint-tmp-*``)."""
    if not os.path.isdir(directory):
        return []
    return [os.path.join(directory, name) for name in os.listdir(directory)
            if _TMP_INFIX in name and name.split(_TMP_INFIX)[0].isdigit()]


def _remove_incomplete_steps(directory: str) -> None:
    """Delete step dirs without a commit marker and tmp dirs of interrupted saves (process 0),
    then wait for every process.

    Step dirs without a marker would make a later save of that step fail and, counted as
    checkpoints, evict a good one from ``max_to_keep``.
    """
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
        for path in _incomplete_step_dirs(directory):
            # info, not warning: the launcher names these before training (launch/pretrain.py)
            logger.info("removing incomplete checkpoint %s (no %s)", path, COMMIT_MARKER)
            shutil.rmtree(path)
        for path in _leftover_tmp_dirs(directory):
            shutil.rmtree(path, ignore_errors=True)
    barrier(unique_key("remove_incomplete"))


def _remove_old_steps(directory: str, max_to_keep: int | None) -> None:
    """Delete all but the newest ``max_to_keep`` complete steps, each renamed to a tmp name
    first so that a kill mid-delete never leaves a marked step with missing files."""
    if max_to_keep is None:
        return
    steps = complete_steps(directory)
    for step in steps[:max(len(steps) - max_to_keep, 0)]:
        doomed = os.path.join(directory, f"{step}{_TMP_INFIX}deleted")
        os.rename(_step_dir(directory, step), doomed)
        shutil.rmtree(doomed)


def _write_step(directory: str, step: int, state: Any, metadata: dict, max_to_keep: int | None,
                save_id: int) -> None:
    """Write and commit one step (every process; the body of a save, in the background with
    ``--async-save``). Each process writes its shards into the tmp dir; once all are done
    process 0 merges the per-process indexes, records the integrity file, writes the commit
    marker, renames the tmp dir to the step and drops old steps; then every process returns.
    A failure on any process is raised on every process, and nothing is committed."""
    orbax_failure_noise.silence()
    tmp = os.path.join(directory, f"{step}{_TMP_INFIX}{save_id}")
    key = call_key(save_id, "save")  # save_id was drawn in the caller's order: the same on every process
    multi = jax.process_count() > 1
    client = ocp.multihost.get_jax_distributed_client() if multi else None
    error: BaseException | None = None
    # The pytree handler under orbax's StandardCheckpointHandler (same files), without zstd: on
    # fp32 weights and Adam moments it saves few bytes and costs about as much CPU as the rest of
    # the write, which an async save takes from the steps (bench/results/2026-11-checkpoints-cpu.md).
    handler = ocp.PyTreeCheckpointHandler(use_compression=False)

    def attempt(action: Callable[[], None]) -> None:
        nonlocal error
        if error is not None:
            return
        try:
            action()
        except Exception as e:
            error = e
            if multi:
                client.key_value_set(f"{key}/error/{jax.process_index()}", f"{type(e).__name__}: {e}")

    def create() -> None:
        if jax.process_index() == 0:
            for item in (STATE_ITEM, META_ITEM):
                os.makedirs(os.path.join(tmp, item))

    def write() -> None:
        # Wait here for the snapshot's copy program: the host transfers orbax starts next then
        # never hold one of XLA's CPU threads waiting for a buffer (with in-process collectives
        # a held thread can starve a training step's rendezvous).
        jax.block_until_ready(state)
        handler.save(epath.Path(tmp) / STATE_ITEM, args=ocp.args.PyTreeSave(state))
        if jax.process_index() == 0:
            ocp.JsonCheckpointHandler().save(epath.Path(tmp) / META_ITEM, args=ocp.args.JsonSave(metadata))

    attempt(create)
    barrier(f"{key}/created")
    if multi and error is None and client.key_value_dir_get(f"{key}/error/"):
        error = OSError("process 0 could not create the checkpoint's directory")
    attempt(write)
    barrier(f"{key}/written")
    if jax.process_index() == 0:
        try:
            others = client.key_value_dir_get(f"{key}/error/") if multi else []
            if error is None and others:
                raise OSError(f"process {others[0][0].rsplit('/', 1)[-1]} failed: {others[0][1]}")
            if error is None:
                handler.finalize(epath.Path(tmp) / STATE_ITEM)
                _write_integrity(tmp)
                with open(os.path.join(tmp, COMMIT_MARKER), "w") as f:
                    f.write(f"checkpoint step {step} committed")
                os.rename(tmp, _step_dir(directory, step))
                _remove_old_steps(directory, max_to_keep)
        except Exception as e:
            error = error or e
        if multi:
            client.key_value_set(f"{key}/outcome", "" if error is None else f"{type(error).__name__}: {error}")
    barrier(f"{key}/committed")
    if error is not None:
        raise error
    if multi and jax.process_index() != 0:
        outcome = client.blocking_key_value_get(f"{key}/outcome", COORDINATION_TIMEOUT_MS)
        if outcome:
            raise OSError(f"checkpoint step {step} not committed: process 0: {outcome}")
