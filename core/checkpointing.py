"""Distributed checkpointing of global ``jax.Array`` pytrees with orbax.

One checkpoint is one step directory written by every process together (a collective, like
Megatron's ``save_checkpoint``)::

    <directory>/<step>/state/   the pytree (orbax's PyTree handler: OCDBT, uncompressed; each
                                process writes only its own shards)
    <directory>/<step>/meta/    a JSON-able dict (iteration, consumed samples, layout, seed...)
    <directory>/<step>/integrity.json  size and CRC-32 of every other file of the step
    <directory>/<step>/commit_success.txt

The files are orbax's (its handlers write and read them), the save's sequence is this module's:
every process writes its shards into ``<step>.orbax-checkpoint-tmp-<n>``; once all have, process
0 merges the per-process indexes, writes ``integrity.json`` and the commit marker
``commit_success.txt`` into it and only then renames it to ``<step>``. A step counts as
complete only when the marker is there, so a half-copied step directory is never reported as
the latest checkpoint nor counted by the ``max_to_keep`` retention (which could then delete the
last good checkpoint). With ``async_save`` all of this runs in the background: in a writer
process per training process (:mod:`core.checkpoint_writer`, the default on Linux) or in a
thread; its barriers use a coordination service, never a device collective.

Restores go straight into the requested shardings, so a checkpoint written with one mesh
layout can be read into any other sharding of the same global shapes. Shapes and the tree
structure are checked against the saved metadata first so that a mismatch is a clear
``ValueError`` rather than an orbax traceback.

Files damaged after the save (a truncated copy, a bad disk) are found by
:func:`verify_checkpoint` against ``integrity.json``; :func:`latest_valid_step` skips such
steps, naming the damaged file, so a resume falls back to the previous intact checkpoint.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import shutil
import threading
import uuid
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from core import checkpoint_writer, orbax_failure_noise

__all__ = ["CheckpointSaver", "complete_steps", "incomplete_steps", "latest_step", "latest_valid_step", "load_metadata",
           "new_run_id", "restore_checkpoint", "save_checkpoint", "step_problem", "verify_checkpoint",
           "why_nothing_to_load"]

logger = logging.getLogger(__name__)

STATE_ITEM = "state"
META_ITEM = "meta"
# Orbax's commit marker: written inside the tmp dir right before the rename (or, on object
# stores, into the final dir as the very last write).
COMMIT_MARKER = "commit_success.txt"
DEFAULT_MAX_TO_KEEP = 2
_UNKNOWN = object()  # CheckpointSaver's newest step, not known yet

ASYNC_WRITERS = ("process", "thread")
"""What may write an asynchronous save (:class:`CheckpointSaver`'s ``writer``)."""
# Size and CRC-32 of every file of a step, written by process 0 right before the commit marker.
INTEGRITY_FILE = "integrity.json"


# ---------------------------------------------------------------------------------------
# Finding complete checkpoints (plain filesystem reads: no collective, any process may call)
# ---------------------------------------------------------------------------------------


def _step_dir(directory: str | os.PathLike, step: int) -> str:
    return os.path.join(os.fspath(directory), str(step))


def _is_complete(step_dir: str) -> bool:
    return os.path.isfile(os.path.join(step_dir, COMMIT_MARKER))


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """Sorted steps of the complete (committed) checkpoints in ``directory``; [] if none or missing."""
    if not os.path.isdir(directory):
        return []
    # Tmp dirs ("<step>.orbax-checkpoint-tmp-<ts>") are not all digits, so they never match.
    return sorted(
        int(name) for name in os.listdir(directory)
        if name.isdigit() and _is_complete(_step_dir(directory, int(name)))
    )


def _incomplete_step_dirs(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return [
        _step_dir(directory, int(name)) for name in os.listdir(directory)
        if name.isdigit() and os.path.isdir(_step_dir(directory, int(name)))
        and not _is_complete(_step_dir(directory, int(name)))
    ]


def incomplete_steps(directory: str | os.PathLike) -> list[int]:
    """Sorted steps whose directory has no commit marker (a save that did not finish: never
    loaded, and removed by the next save into ``directory``); [] if none or no directory."""
    return sorted(int(os.path.basename(path)) for path in _incomplete_step_dirs(os.fspath(directory)))


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest complete checkpoint step in ``directory``; None if there is none (or no directory)."""
    steps = complete_steps(directory)
    return steps[-1] if steps else None


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return crc


def _file_record(step_dir: str) -> dict[str, list[int]]:
    """``{relative path: [size, crc32]}`` of every file of a step directory."""
    record = {}
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, step_dir)
            if not rel.startswith(INTEGRITY_FILE):  # the record itself and its tmp file
                record[rel] = [os.path.getsize(path), _crc32(path)]
    return record


def _write_integrity(step_dir: str) -> None:
    tmp = os.path.join(step_dir, INTEGRITY_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_file_record(step_dir), f, sort_keys=True)
    os.replace(tmp, os.path.join(step_dir, INTEGRITY_FILE))


def verify_checkpoint(directory: str | os.PathLike, step: int) -> str | None:
    """None when every file of ``step`` has the size and CRC-32 it was written with (or the step
    predates integrity records); else one phrase naming the first damaged file."""
    step_dir = _step_dir(os.path.abspath(directory), step)
    record_path = os.path.join(step_dir, INTEGRITY_FILE)
    if not os.path.isfile(record_path):
        return None
    try:
        with open(record_path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        return f"{record_path} is unreadable ({e})"
    for rel, (size, crc) in sorted(record.items()):
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return f"{path} is missing"
        if os.path.getsize(path) != size:
            return f"{path} has {os.path.getsize(path)} bytes, {size} were written (truncated)"
        if _crc32(path) != crc:
            return f"{path} differs from what was written (CRC-32 mismatch: corrupted)"
    return None


def _find_latest_valid(directory: str | os.PathLike) -> tuple[int | None, list[str]]:
    skipped = []
    for step in reversed(complete_steps(directory)):
        problem = verify_checkpoint(directory, step)
        if problem is None:
            return step, skipped
        skipped.append(f"checkpoint step {step} skipped: {problem}")
    return None, skipped


def latest_valid_step(directory: str | os.PathLike) -> tuple[int | None, list[str]]:
    """The newest complete step whose files are intact (None if none), and one line for each
    newer complete step skipped because a file is damaged.

    Collective when there are several processes: process 0 alone reads and checksums the
    files and hands its answer to the others (through the coordination service), so every
    process resumes from the same step at the cost of one read of the checkpoint."""
    step, skipped = _from_process_0("latest_valid_step", lambda: _find_latest_valid(directory))
    return step, list(skipped)


def step_problem(directory: str | os.PathLike, step: int) -> str | None:
    """Why step ``step`` of ``directory`` cannot be loaded (one phrase: not there, incomplete, or
    the first damaged file), or None when it is complete and intact. Collective as
    :func:`latest_valid_step`: process 0 alone reads the files."""

    def check() -> str | None:
        steps = complete_steps(directory)
        if step not in steps:
            found = steps if os.path.isdir(directory) else "no such directory"
            return f"no complete checkpoint {step} (complete checkpoints: {found})"
        return verify_checkpoint(directory, step)

    return _from_process_0("step_problem", check)


def new_run_id() -> str:
    """A new identifier for a training run, the same on every process (process 0 draws it; a
    collective). Checkpoints record it, a resume keeps it, so a ``--save`` directory can tell
    its own run's checkpoints from another run's."""
    return _from_process_0("run_id", lambda: uuid.uuid4().hex[:12])


def why_nothing_to_load(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` holds no loadable checkpoint (one phrase naming what was found and
    skipped), or None when it holds one. For the warning before training starts from scratch."""
    directory = os.fspath(directory)
    if latest_step(directory) is not None:
        return None
    if not os.path.exists(directory):
        return "no such directory"
    if not os.path.isdir(directory):
        return "not a directory"
    incomplete = sorted(int(os.path.basename(p)) for p in _incomplete_step_dirs(directory))
    if incomplete:
        return f"no complete checkpoint (skipped incomplete step directories {incomplete}: no {COMMIT_MARKER})"
    entries = sorted(os.listdir(directory))
    return "an empty directory" if not entries else f"no checkpoint step directory (found {entries[:5]})"


def _require_step(directory: str, step: int | None) -> int:
    """``step`` (or the latest one when None), checked to be a complete checkpoint."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    if step is None:
        step = latest_step(directory)
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {directory!r}")
        return step
    if not _is_complete(_step_dir(directory, step)):
        raise FileNotFoundError(
            f"no complete checkpoint for step {step} in {directory!r} "
            f"(complete steps: {complete_steps(directory)})"
        )
    return step


def load_metadata(directory: str | os.PathLike, step: int | None = None) -> dict:
    """The metadata dict saved with ``step`` (the latest complete step when None)."""
    directory = os.path.abspath(directory)
    step = _require_step(directory, step)
    # Handler-level read: unlike a CheckpointManager it has no barriers, so any process may call it.
    path = epath.Path(_step_dir(directory, step)) / META_ITEM
    return dict(ocp.JsonCheckpointHandler().restore(path, args=ocp.args.JsonRestore()))


# ---------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------


# Barriers and broadcasts go through the jax.distributed client's coordination service (its
# barrier and key-value store), never through a device collective: the background writer runs
# them while the main thread dispatches training steps, whose collectives must be issued in
# the same order on every process.
_COORDINATION_TIMEOUT_MS = 3600 * 1000
_collective_ids = itertools.count()  # every process makes the same collective calls in the same order


def _call_key(call_id: int, name: str) -> str:
    """The coordination-service key ``name`` (no slashes) of collective call ``call_id``."""
    return f"megatron_core_jax/checkpointing/{call_id}/{name}"


def _unique_key(name: str) -> str:
    """A coordination-service key no other call of this run uses (``name``: no slashes)."""
    return _call_key(next(_collective_ids), name)


def _barrier(key: str) -> None:
    """Wait for every process at ``key`` (unique per call: from :func:`_unique_key`)."""
    if jax.process_count() > 1:
        ocp.multihost.get_barrier_sync_fn()(key=key, timeout_ms=_COORDINATION_TIMEOUT_MS)


def _from_process_0(name: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` run on process 0 only, its (JSON-able) result handed to every process.
    An exception on process 0 is raised on every process (as ``OSError`` on the others)."""
    if jax.process_count() == 1:
        return compute()
    client = ocp.multihost.get_jax_distributed_client()
    key = _unique_key(name)
    if jax.process_index() == 0:
        try:
            value = compute()
        except Exception as e:
            client.key_value_set(key, json.dumps({"error": f"{type(e).__name__}: {e}"}))
            raise
        client.key_value_set(key, json.dumps({"value": value}))
        return value
    answer = json.loads(client.blocking_key_value_get(key, _COORDINATION_TIMEOUT_MS))
    if "error" in answer:
        raise OSError(f"process 0 failed: {answer['error']}")
    return answer["value"]


_TMP_INFIX = ".orbax-checkpoint-tmp-"  # orbax's name for a step being written, kept for old runs


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
    _barrier(_unique_key("remove_incomplete"))


@jax.jit
def _copy_arrays(arrays: list[jax.Array]) -> list[jax.Array]:
    # A real copy into new buffers (an output that is just an input would be forwarded).
    return [jnp.copy(x) for x in arrays]


def _snapshot(state: Any) -> Any:
    """A copy of ``state`` that the caller's later updates cannot touch: the ``jax.Array``
    leaves are copied on their devices by one jitted program, dispatched and not waited for
    (a training step may donate the original buffers right after; the copy is ordered before
    it); numpy arrays are copied on the host; other leaves are immutable."""
    leaves, treedef = jax.tree.flatten(state)
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    out = [leaf.copy() if isinstance(leaf, np.ndarray) else leaf for leaf in leaves]
    for i, copy in zip(arrays, _copy_arrays([leaves[i] for i in arrays])):
        out[i] = copy
    return jax.tree.unflatten(treedef, out)


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
    key = _call_key(save_id, "save")  # save_id was drawn in the caller's order: the same on every process
    multi = jax.process_count() > 1
    client = ocp.multihost.get_jax_distributed_client() if multi else None
    error: BaseException | None = None
    # The pytree handler under orbax's StandardCheckpointHandler (same files), without zstd: on
    # fp32 weights and Adam moments it saved 7% of the bytes and cost as much CPU as the rest of
    # the write (hidden 512: 410 -> 213 ms of CPU per save), which an async save takes from the steps.
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
    _barrier(f"{key}/created")
    if multi and error is None and client.key_value_dir_get(f"{key}/error/"):
        error = OSError("process 0 could not create the checkpoint's directory")
    attempt(write)
    _barrier(f"{key}/written")
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
    _barrier(f"{key}/committed")
    if error is not None:
        raise error
    if multi and jax.process_index() != 0:
        outcome = client.blocking_key_value_get(f"{key}/outcome", _COORDINATION_TIMEOUT_MS)
        if outcome:
            raise OSError(f"checkpoint step {step} not committed: process 0: {outcome}")


WRITER_NICE = checkpoint_writer.WRITER_NICE
"""The nice value of the background writer thread on the CPU backend (Linux): the writer
process's."""


def _lower_thread_priority_on_cpu() -> None:
    """On the CPU backend the training steps and the background writer share the cores: at
    normal priority the write's CPU work (host copies, serialization, checksums) lands on the
    steps (a 116% stall of one step at the default model on 2 cores). At the lowest priority
    the writer takes the cycles the steps leave. Only this thread (Linux priorities are per
    thread); GPU runs keep the default (their steps do not use the host's cores)."""
    if jax.default_backend() != "cpu" or not hasattr(threading, "get_native_id"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (OSError, AttributeError):  # not Linux, or not permitted: keep the default
        pass


class _SaveThread:
    """The daemon thread that runs a saver's asynchronous writes, one at a time. It is started
    once: starting a thread waits until the new thread runs, which on busy CPU cores took
    2-3 ms of each save's blocking part (of 5 ms at the default model)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._done.set()  # nothing submitted: result() returns at once
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="checkpoint-save", daemon=True).start()

    def submit(self, write: Callable, *args: Any) -> None:
        """Run ``write(*args)`` in the thread (the previous one must be finished)."""
        self._done.clear()
        self._jobs.put((write, args))

    def finished(self) -> bool:
        """Whether the submitted write is done (without waiting)."""
        return self._done.is_set()

    def result(self) -> BaseException | None:
        """Wait for the submitted write; the error it raised, if any (once: then None)."""
        self._done.wait()
        error, self._error = self._error, None
        return error

    def stop(self) -> None:
        """End the thread once the submitted write is done."""
        self._jobs.put(None)

    def _run(self) -> None:
        _lower_thread_priority_on_cpu()
        while (job := self._jobs.get()) is not None:
            write, args = job
            try:
                write(*args)
            except BaseException as e:  # raised on the main thread by CheckpointSaver.wait()
                self._error = e
            del job, write, args  # drop the snapshot's arrays now, not at the next save
            self._done.set()


class CheckpointSaver:
    """The saves of one checkpoint directory, synchronous or asynchronous.

    Asynchronous (``async_save``): :meth:`save` only dispatches an on-device copy of the arrays
    (so the next training step may update or donate the originals) and hands the copy to a
    background thread, which copies it to the host and has the writer (``writer``: a writer
    process or this thread) write the files, commit the step and record its integrity file
    while training goes on. Synchronous: the same work in this process, waited for.

    At most one save is in flight: the next :meth:`save` (or :meth:`wait`, :meth:`close`) first
    waits for it and raises the error it met, if any. Saves are atomic: each process writes its
    shards into ``<step>.orbax-checkpoint-tmp-<n>``; process 0 writes ``integrity.json`` and the
    commit marker into it and renames it to ``<step>`` only after every process has written; a
    process killed mid-save leaves the previous checkpoints intact. Collective: every process
    calls every method with the same arguments; the background threads of the processes meet
    only at the coordination service's barriers and key-value store.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = DEFAULT_MAX_TO_KEEP,
                 async_save: bool = False, writer: str | None = None, pinned_host_transfer: bool | None = None):
        self.directory = os.path.abspath(directory)
        """Where the step directories go."""
        self.max_to_keep = max_to_keep
        """Newest checkpoints kept (None keeps all)."""
        self.async_save = async_save
        """Write in the background (:meth:`save` returns after dispatching an on-device copy)."""
        if writer not in (None, *ASYNC_WRITERS):
            raise ValueError(f"writer must be one of {ASYNC_WRITERS}, not {writer!r}")
        self.writer = writer or ("process" if checkpoint_writer.available() else "thread")
        """What writes an asynchronous save: ``"process"`` (a writer process per training
        process, :mod:`core.checkpoint_writer`; the default on Linux) or ``"thread"`` (a thread
        of the training process, which shares its GIL)."""
        self.pinned_host_transfer = jax.default_backend() == "gpu" if pinned_host_transfer is None \
            else pinned_host_transfer
        """The writer process's device-to-host copies go through pinned host memory (default:
        on GPUs, as orbax's ``enable_pinned_host_transfer``, which the writer thread's and the
        synchronous saves' orbax handler applies itself)."""
        self._thread: _SaveThread | None = None
        self._process: checkpoint_writer.WriterProcess | None = None
        # The newest step in the directory once this saver has looked (its own last save after
        # that): the next save checks against it without listing the directory, a listing that
        # an async save's blocking part would spend on the step loop. Unknown (_UNKNOWN) at first
        # and after a failed save, whose leftovers the next save then removes.
        self._latest: int | None | object = _UNKNOWN

    def save(self, step: int, state: Any, metadata: dict, copy: bool = True) -> None:
        """Save ``state`` (a pytree of global arrays, numpy arrays, python scalars) and
        ``metadata`` as ``step``. Synchronous: returns once the checkpoint is committed.
        Asynchronous: returns at once; the commit follows in the background. ``copy=False``
        saves ``state`` itself instead of a snapshot of it: for arrays that are already the
        caller's own copies, which nothing updates or donates later (saves device memory and a
        copy). Raises ``ValueError`` if ``step`` is not newer than the latest complete
        checkpoint."""
        self.wait()
        if self._latest is _UNKNOWN:
            _remove_incomplete_steps(self.directory)
            self._latest = latest_step(self.directory)
        last = self._latest
        if last is not None and step <= last:
            raise ValueError(
                f"cannot save step {step} in {self.directory!r}: it is not newer than the latest checkpoint {last}"
            )
        snapshot = _snapshot(state) if copy else state
        metadata = json.loads(json.dumps(metadata))
        save_id = next(_collective_ids)
        self._latest = _UNKNOWN  # until the write is known to have committed
        if not self.async_save:
            _write_step(self.directory, step, snapshot, metadata, self.max_to_keep, save_id)
            self._latest = step
            return
        write = _write_step
        if self.writer == "process":
            if self._process is None:  # started here, on the caller's (main) thread: see WriterProcess
                address = _from_process_0("writer_address", checkpoint_writer.coordinator_address) \
                    if jax.process_count() > 1 else None
                self._process = checkpoint_writer.WriterProcess(address, jax.default_backend() == "cpu",
                                                                self.pinned_host_transfer)
            write = self._process.write
        if self._thread is None:
            self._thread = _SaveThread()
            weakref.finalize(self, self._thread.stop)  # a saver dropped without close() ends it too
        self._thread.submit(write, self.directory, step, snapshot, metadata, self.max_to_keep, save_id)
        self._latest = step  # wait() forgets it if the write fails

    @property
    def write_phases(self) -> dict[str, float]:
        """The writer process's last save, timed on this process's side by phase (seconds;
        :attr:`core.checkpoint_writer.WriterProcess.phases`); empty without one."""
        return dict(self._process.phases) if self._process is not None else {}

    def finished(self) -> bool:
        """Whether no save is in flight (its commit done or failed; :meth:`wait` returns at once)."""
        return self._thread is None or self._thread.finished()

    def wait(self) -> None:
        """Wait for the save in flight (if any) to be committed; raise its error, if it failed
        (``OSError`` or ``ValueError`` as the write reported it; another kind wrapped in
        ``OSError``)."""
        error = None if self._thread is None else self._thread.result()
        if error is None:
            return
        self._latest = _UNKNOWN
        if self._process is not None and not self._process.alive:  # the next save starts a new one
            self._process.close()
            self._process = None
        if isinstance(error, (OSError, ValueError)):
            raise error
        raise OSError(f"{type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Wait for the save in flight (raising its error, if any), then stop the save thread
        and the writer process, if they were started (collective; a later save starts new ones)."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._thread.stop()
                self._thread = None
            if self._process is not None:
                self._process.close()
                self._process = None


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    state: Any,
    metadata: dict,
    max_to_keep: int | None = DEFAULT_MAX_TO_KEEP,
) -> None:
    """Save ``state`` (a pytree of global arrays, numpy arrays, python scalars) and ``metadata``.

    Collective: every process must call it with the same arguments. Blocks until the
    checkpoint is committed, so a process killed right after this returns leaves a complete
    checkpoint. Keeps only the newest ``max_to_keep`` checkpoints (None keeps all).
    Raises ``ValueError`` if ``step`` is not newer than the latest complete checkpoint
    (orbax would otherwise skip the save silently, or keep the wrong checkpoints).
    """
    saver = CheckpointSaver(directory, max_to_keep)
    try:
        saver.save(step, state, metadata)
    finally:
        saver.close()


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
    # Every process has read its shards before any returns (a CheckpointManager's restore ended
    # the same way): nothing a process does next, such as a save's cleanup, can touch the files
    # another one is still reading.
    _barrier(_unique_key("restored"))
    return state, load_metadata(directory, step)
