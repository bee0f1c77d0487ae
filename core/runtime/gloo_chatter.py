"""Keep gloo's connection chatter out of a CPU job's standard output.

On the CPU backend, XLA's cross-process collectives run on gloo, which prints one line per
communicator it connects, from C++ straight to file descriptor 1::

    [Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7

Communicators connect lazily, when the first program that uses a device group runs (the first
training step, usually; a later program with a new group connects more), so the lines cannot be
silenced around one call. :func:`filter_gloo_chatter` instead puts a pipe on file descriptor 1
and a small filter process behind it that forwards everything to the original standard output
except those lines. Python's ``sys.stdout`` keeps writing to file descriptor 1, unchanged; child
processes that inherit it (the checkpoint writer) are filtered too. The filter outlives its
writers, so nothing written before a crash or ``os._exit`` is lost: it ends when the last of them
has closed the pipe.

:func:`core.runtime.cluster.initialize_distributed` calls it on the CPU backend only (a GPU job's
collectives are NCCL's; nothing changes there). ``MCJ_GLOO_LOGS=1`` keeps the lines (as does
``launch/pretrain.py --debug``).
"""

from __future__ import annotations

import os
import subprocess
import sys

ENV_VAR = "MCJ_GLOO_LOGS"
"""Set to 1 to keep gloo's connection lines on standard output."""

FILTER_SOURCE = r"""
import os, signal
# Ctrl-C and the launcher's signals are for the writers: the filter drains the pipe until they are gone.
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(s, signal.SIG_IGN)
PREFIX = b"[Gloo] "

def chatter(line):
    return line.startswith(PREFIX + b"Rank ") and b" is connected to " in line

out_ok = True
def emit(data):
    global out_ok
    while data and out_ok:  # the reader gone: keep draining, so the writers never see a broken pipe
        try:
            data = data[os.write(1, data):]
        except InterruptedError:
            continue
        except OSError:
            out_ok = False

held, at_start, gloo = b"", True, False  # held: the start of a line not yet known to be chatter or not
while True:
    try:
        chunk = os.read(0, 65536)
    except InterruptedError:
        continue
    except OSError:
        break
    if not chunk:
        break
    data, held, kept, i = held + chunk, b"", [], 0
    while i < len(data):
        if at_start:
            head = data[i:i + len(PREFIX)]
            if len(head) < len(PREFIX) and PREFIX.startswith(head):  # too short to tell: wait for more
                held = data[i:]
                break
            gloo, at_start = head == PREFIX, False
        end = data.find(b"\n", i)
        if gloo:  # held whole, then dropped only if it is the connection line
            if end < 0:
                held = data[i:]
                at_start = True
                break
            if not chatter(data[i:end + 1]):
                kept.append(data[i:end + 1])
        else:
            kept.append(data[i:] if end < 0 else data[i:end + 1])
        if end < 0:
            break
        at_start, i = True, end + 1
    emit(b"".join(kept))
emit(held)
"""
"""The filter process's program: reads the pipe (fd 0), writes the original stdout (fd 1)."""

_filter: subprocess.Popen | None = None


def filter_gloo_chatter(environ=None) -> bool:
    """Route this process's file descriptor 1 through a filter that drops gloo's connection lines
    (see the module docstring); once per process. Returns whether the filter is in place: not
    when ``MCJ_GLOO_LOGS=1``, when standard output is closed or ``/dev/null``, or when the filter
    cannot start (then the output is as it was)."""
    global _filter
    environ = os.environ if environ is None else environ
    if _filter is not None:
        return True
    if environ.get(ENV_VAR, "").strip() in ("1", "true", "yes"):
        return False
    try:
        if os.path.samestat(os.fstat(1), os.stat(os.devnull)):
            return False  # nothing to keep
        original = os.dup(1)
    except OSError:
        return False
    read, write = os.pipe()
    try:
        sys.stdout.flush()
        _filter = subprocess.Popen([sys.executable, "-I", "-S", "-c", FILTER_SOURCE], stdin=read, stdout=original,
                                   close_fds=True)
        os.dup2(write, 1)
    except (OSError, ValueError, subprocess.SubprocessError):
        return False
    finally:
        for fd in (read, write, original):
            os.close(fd)
    return True
