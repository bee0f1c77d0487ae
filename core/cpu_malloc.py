"""glibc malloc settings for XLA's CPU runtime: huge pages, and freed memory kept for the next step.

XLA's CPU runtime allocates each step's large buffers with ``malloc``; glibc serves them with
``mmap`` and ``munmap``-s them on free, so every step page-faults its working set in again, 4 KiB
at a time. Measured on the end-to-end GPT (4 layers, hidden 256, batch 32 x 256, one process,
2 cores): 285k minor faults (1.1 GB) and 0.7-0.9 s of system time per forward-backward, 2.8-3.1 s
wall. The settings, chosen by how many threads run the process's XLA programs:

* both: transparent huge pages (``hugetlb=1``: glibc ``madvise``-s its mappings), no ``mmap``
  for large blocks and no trimming (``mmap_max=0``, a 64 GiB ``trim_threshold``), so a step's
  freed buffers stay in the process and the next step reuses them.
* :data:`THREAD_ARENA_TUNABLES` (several threads: one process with several devices, pipeline
  layouts with the full pool): each thread keeps its own arena. A thread arena grows in heaps of
  at most 64 MiB, and glibc ``mmap``-s any larger block whatever ``mmap_max`` says: each device's
  temp block (472 MB for the GPT at one process, two devices) was mapped, zeroed by the kernel
  and unmapped every step (``strace``: ~1440 faults, 0.13-0.19 s of system time per step, ~7% of
  the two cores). :data:`XLA_HEAP_FLAG` makes XLA split each program's temp into heaps of about
  32 MiB (the same 472 MB in all; XLA's ``xla_multiheap_size_constraint_per_heap``), which fit
  in a thread arena's heaps, and a 64 MiB ``top_pad`` keeps glibc from deleting a heap that
  became all free: no faults and no system time per step. One process, two devices,
  6 interleaved pairs on 2026-11-25: 1.12-1.22 -> 1.01-1.12 s per step (medians 1.18 -> 1.06;
  5 pairs faster, 1 level); peak memory 1712 -> 1926-1983 MiB (the arenas keep what they held).
  pp=2 at 2 processes, 2 pairs: 1.52-1.54 -> 1.47-1.50 s, 880-920 -> 1160-1280 MiB.
* :data:`KEEP_FREED_TUNABLES` (one thread: a process whose share of the host is one core and
  whose pool is sized to it): one arena (``arena_max=1``), so every block comes from the main
  heap (one core, global batch 16: 259 faults and 0.05-0.07 s system time per step before, plus
  0.4-0.5 s spikes when the kernel compacted memory for huge pages; 4 processes on 2 cores:
  1.04-1.09 -> 0.97-1.04 s per step). No XLA flag there: split heaps only fragment the one
  arena (tp=2 at 2 processes, 2 pairs: 1.30-1.32 s per step either way, peak memory 1252-1255
  -> 1844-1855 MiB with the flag). With several threads allocating, the one arena cost more
  than it saved: the device threads waited ~10% of the step on its lock (one process, two
  devices, 7 interleaved pairs on 2026-11-24: 1.07-1.31 vs 1.00-1.11 s per step), and it
  fragmented to 1.25-1.5x the peak memory.

Tunables are only read at process start, so :func:`reexec_with_malloc_settings` re-executes the
interpreter once with them (first thing in a launch script, before MPI or JAX start); for
several threads it also adds :data:`XLA_HEAP_FLAG` to ``XLA_FLAGS``. ``MCJ_MALLOC_TUNING=0`` opts
out; a tunable or XLA flag the user set keeps the user's value. Needs glibc >= 2.35 (and for the huge pages the
kernel's THP mode ``madvise`` or ``always``); elsewhere inert.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

_KEEP_HEAP_TUNABLES = (
    "glibc.malloc.hugetlb=1",  # transparent huge pages on malloc's memory
    "glibc.malloc.mmap_max=0",  # blocks come from the arenas' heaps and go back to them
    "glibc.malloc.trim_threshold=68719476736",  # and the heaps are not given back to the kernel
)

THREAD_ARENA_TUNABLES = _KEEP_HEAP_TUNABLES + (
    "glibc.malloc.top_pad=67108864",  # not even a thread arena's heap that became all free
)
"""Tunables for processes whose XLA programs run on several threads: each thread's arena keeps
what the step freed (with :data:`XLA_HEAP_FLAG`, every block fits in an arena's heap)."""

KEEP_FREED_TUNABLES = ("glibc.malloc.arena_max=1",) + _KEEP_HEAP_TUNABLES  # every block from the main heap
"""Tunables for processes whose XLA programs run on one thread: one arena, freed memory stays for the next step."""

XLA_HEAP_FLAG = "--xla_multiheap_size_constraint_per_heap=33554432"
"""XLA flag: split each program's temp buffer into heaps of about 32 MiB (a thread arena's heap is 64 MiB)."""

OPT_OUT_VAR = "MCJ_MALLOC_TUNING"
"""Set to ``0`` to skip the malloc settings."""


def malloc_settings_update(environ: Mapping[str, str], one_thread: bool = False) -> dict[str, str]:
    """The ``GLIBC_TUNABLES`` / ``XLA_FLAGS`` update that adds the settings for a process whose XLA
    programs run on one thread (``one_thread``: no XLA flag) or several; tunables and the XLA
    flag the user already set keep their value. Empty when nothing is missing or the user opted
    out."""
    if environ.get(OPT_OUT_VAR, "1") == "0":
        return {}
    update = {}
    current = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    present = {t.split("=", 1)[0] for t in current}
    wanted = KEEP_FREED_TUNABLES if one_thread else THREAD_ARENA_TUNABLES
    missing = [t for t in wanted if t.split("=", 1)[0] not in present]
    if missing:
        update["GLIBC_TUNABLES"] = ":".join(current + missing)
    flags = environ.get("XLA_FLAGS", "")
    if not one_thread and XLA_HEAP_FLAG.split("=", 1)[0] not in flags:
        update["XLA_FLAGS"] = f"{flags} {XLA_HEAP_FLAG}".strip()
    return update


def is_glibc_linux() -> bool:
    """Whether this process runs on Linux with glibc (asks libc; no scan of the interpreter binary)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError):
        return False


def reexec_with_malloc_settings(one_thread: bool = False) -> None:
    """Re-execute this Python process with the malloc settings added when a tunable is missing.

    ``one_thread``: this process's XLA programs will run on one thread (see
    :func:`core.cpu_threads.xla_pool_threads`). A no-op off glibc Linux or when opted out; when
    only the XLA flag is missing it is set without a re-exec (XLA reads it when its backend
    starts), so the process re-executes at most once. Call first thing in a launch script,
    before JAX starts or the process's CPU affinity changes: the process image is replaced.
    """
    if not is_glibc_linux():
        return
    update = malloc_settings_update(os.environ, one_thread)
    os.environ.update(update)
    if "GLIBC_TUNABLES" not in update:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
