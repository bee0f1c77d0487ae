"""``CheckpointSaver`` and ``save_checkpoint``: synchronous and asynchronous saves of global-array
pytrees. An asynchronous save snapshots the state on device (one jitted copy, dispatched and not
waited for) and writes it in the background: in a writer process per training process
(:mod:`core.checkpointing.writer_process`, the default on Linux) or in a thread.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from core.checkpointing import coordination, writer_process
from core.checkpointing.coordination import from_process_0
from core.checkpointing.files import ASYNC_WRITERS, DEFAULT_MAX_TO_KEEP, latest_step
from core.checkpointing.step_writer import _remove_incomplete_steps, _write_step

_UNKNOWN = object()  # CheckpointSaver's newest step, not known yet


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


WRITER_NICE = writer_process.WRITER_NICE
"""The nice value of the background writer thread on the CPU backend (Linux): the writer
process's."""


def _lower_thread_priority_on_cpu() -> None:
    """On the CPU backend the training steps and the background writer share the cores: at
    normal priority the write's CPU work (host copies, serialization, checksums) lands on the
    steps, stalling them by more than a whole step. At the lowest priority
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
    once: starting a thread waits until the new thread runs, which on busy CPU cores is a large
    share of a save's blocking part."""

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
        self.writer = writer or ("process" if writer_process.available() else "thread")
        """What writes an asynchronous save: ``"process"`` (a writer process per training
        process, :mod:`core.checkpointing.writer_process`; the default on Linux) or ``"thread"`` (a thread
        of the training process, which shares its GIL)."""
        self.pinned_host_transfer = jax.default_backend() == "gpu" if pinned_host_transfer is None \
            else pinned_host_transfer
        """The writer process's device-to-host copies go through pinned host memory (default:
        on GPUs, as orbax's ``enable_pinned_host_transfer``, which the writer thread's and the
        synchronous saves' orbax handler applies itself)."""
        self._thread: _SaveThread | None = None
        self._process: writer_process.WriterProcess | None = None
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
        save_id = next(coordination.collective_ids)
        self._latest = _UNKNOWN  # until the write is known to have committed
        if not self.async_save:
            _write_step(self.directory, step, snapshot, metadata, self.max_to_keep, save_id)
            self._latest = step
            return
        write = _write_step
        if self.writer == "process":
            if self._process is None:  # started here, on the caller's (main) thread: see WriterProcess
                address = from_process_0("writer_address", writer_process.coordinator_address) \
                    if jax.process_count() > 1 else None
                self._process = writer_process.WriterProcess(address, jax.default_backend() == "cpu",
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
        :attr:`core.writer_process.WriterProcess.phases`); empty without one."""
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
