"""Writing files so that a failure, a signal or a full disk never costs the previous version.

Every writer of the package's outputs (indexed datasets, their index caches, checkpoints'
side files) writes under a temporary name in the destination directory, then renames the
result into place: a rename within one filesystem is atomic, so a reader sees the old file or
the new one, never a mix, and an interrupted write leaves only a temporary file behind (named
``.tmp-*``, removed on the way out when the process can still run Python).

Files that belong together (a dataset's ``.bin`` and ``.idx``) are renamed one after the other
with SIGINT, SIGTERM and SIGHUP held back, so no catchable signal lands between the two renames.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

TMP_PREFIX = ".tmp-"
"""Start of the temporary names (hidden files in the destination directory)."""

_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def temporary_path(path: str) -> str:
    """A new, empty file next to ``path`` (same directory, so the final rename stays on one
    filesystem), named ``.tmp-XXXXXXXX-<basename>``; the caller renames or removes it."""
    directory = os.path.dirname(os.path.abspath(path))
    handle, tmp = tempfile.mkstemp(dir=directory, prefix=TMP_PREFIX, suffix="-" + os.path.basename(path))
    os.close(handle)
    # mkstemp makes the file private (0600); the renamed result gets what open() would have given.
    os.chmod(tmp, 0o666 & ~_umask())
    return tmp


def _umask() -> int:
    """The process's umask, read without changing it where Linux reports it (``os.umask`` sets a
    new one to read the old, a moment in which another thread's files would get the wrong mode)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_quietly(path: str) -> None:
    """Delete ``path`` if it exists (cleanup after a failed write; errors ignored)."""
    with contextlib.suppress(OSError):
        os.remove(path)


def _fsync(path: str) -> None:
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold back SIGINT, SIGTERM and SIGHUP (delivered when the block ends); a no-op off the
    main thread, whose mask Python's handlers do not use."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def replace_together(moves: Sequence[tuple[str, str]]) -> None:
    """Rename each ``(temporary, final)`` pair into place, after syncing the temporaries to disk,
    with catchable signals held back between the first rename and the last."""
    for tmp, _ in moves:
        _fsync(tmp)
    with _signals_held():
        for tmp, final in moves:
            os.replace(tmp, final)


def write_atomically(path: str, write: Callable[[IO[Any]], None], mode: str = "wb") -> None:
    """Write ``path`` by calling ``write`` on a temporary file in its directory, then rename it
    into place; on any failure the temporary file is removed and ``path`` is left as it was."""
    tmp = temporary_path(path)
    try:
        with open(tmp, mode) as stream:
            write(stream)
        replace_together([(tmp, path)])
    except BaseException:
        remove_quietly(tmp)
        raise


def write_text_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` as :func:`write_atomically` does, creating its directory first
    (the benchmarks' and tools' reports)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomically(path, lambda stream: stream.write(text), mode="w")
