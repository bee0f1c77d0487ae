"""glibc malloc settings for XLA's CPU runtime: huge pages, and keeping freed memory in one-thread processes.

XLA's CPU runtime allocates each step's large buffers with ``malloc``; glibc serves them with
``mmap`` and ``munmap``-s them on free, so every step page-faults its working set in again, 4 KiB
at a time. Measured on the end-to-end GPT (4 layers, hidden 256, batch 32 x 256, one process,
2 cores): 285k minor faults (1.1 GB) and 0.7-0.9 s of system time per forward-backward, 2.8-3.1 s
wall. Two settings, chosen by how many threads run the process's XLA programs:

* :data:`THP_TUNABLES` (several threads): glibc asks for transparent huge pages (``madvise``) on
  those mappings: 2-3k faults, 0.2 s system time, 2.0-2.1 s wall, the same peak memory. The
  kernel still zeroes every huge page of every fresh mapping and now and then compacts memory
  to find huge pages (0.4-0.5 s system-time spikes in one step of three to six). The fresh
  mappings are the step's temp block, one per device (472 MB each for the GPT at one process,
  batch 32, two devices): the device's thread allocates it from its own arena, and glibc serves
  a block larger than a thread arena's 64 MiB heap with ``mmap`` whatever ``mmap_max`` says, so
  it is mapped and unmapped every step (``strace``): ~1440 faults, 0.13-0.19 s of system time
  per step.
* :data:`KEEP_FREED_TUNABLES` (one thread: a process whose share of the host is one core and
  whose pool is sized to it): one arena, no ``mmap``, no trimming, so a step's freed buffers
  stay in the process and the next step reuses them: no faults and no system time at all (one
  core, global batch 16: 259 faults and 0.05-0.07 s system time per step before, plus the
  spikes; 4 processes on 2 cores: 1.04-1.09 -> 0.97-1.04 s per step). With several threads
  allocating, the one arena cost more than it saved (one process, two devices: 1.05-1.09 ->
  1.09-1.12 s per step; pp=2 at 2 processes: 1.43-1.45 -> 1.52-1.54 s) and fragmented to
  1.25-1.5x the peak memory, hence the split. Re-measured 2026-11-24 (one process, two
  devices, 7 interleaved pairs): no faults and 0.01 s of system time, but 1.07-1.31 vs
  1.00-1.11 s per step, the device threads idle ~10% of the step waiting on the one arena's
  lock (CPU time 2.1-2.2 s per step either way); a larger ``tcache_count`` does not help.

Tunables are only read at process start, so :func:`reexec_with_malloc_settings` re-executes the
interpreter once with them (first thing in a launch script, before MPI or JAX start).
``MCJ_MALLOC_TUNING=0`` opts out; a tunable the user set keeps the user's value. Needs glibc >=
2.35 (and for the huge pages the kernel's THP mode ``madvise`` or ``always``); elsewhere inert.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

THP_TUNABLES = ("glibc.malloc.hugetlb=1",)
"""Tunables for processes whose XLA programs run on several threads: ``madvise(MADV_HUGEPAGE)``
on malloc's mappings."""

KEEP_FREED_TUNABLES = (
    "glibc.malloc.hugetlb=1",
    "glibc.malloc.arena_max=1",  # other threads' arenas would still mmap blocks over 64 MiB
    "glibc.malloc.mmap_max=0",  # large blocks come from the heap and go back to it
    "glibc.malloc.trim_threshold=68719476736",  # and the heap is not given back to the kernel
)
"""Tunables for processes whose XLA programs run on one thread: freed memory stays for the next step."""

OPT_OUT_VAR = "MCJ_MALLOC_TUNING"
"""Set to ``0`` to skip the malloc settings."""


def malloc_settings_update(environ: Mapping[str, str], one_thread: bool = False) -> dict[str, str]:
    """The ``GLIBC_TUNABLES`` update that adds the settings for a process whose XLA programs run on
    one thread (``one_thread``) or several; tunables already set keep their value. Empty when
    nothing is missing or the user opted out."""
    if environ.get(OPT_OUT_VAR, "1") == "0":
        return {}
    current = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    present = {t.split("=", 1)[0] for t in current}
    wanted = KEEP_FREED_TUNABLES if one_thread else THP_TUNABLES
    missing = [t for t in wanted if t.split("=", 1)[0] not in present]
    return {"GLIBC_TUNABLES": ":".join(current + missing)} if missing else {}


def is_glibc_linux() -> bool:
    """Whether this process runs on Linux with glibc (asks libc; no scan of the interpreter binary)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError):
        return False


def reexec_with_malloc_settings(one_thread: bool = False) -> None:
    """Re-execute this Python process with the malloc settings added when any is missing.

    ``one_thread``: this process's XLA programs will run on one thread (see
    :func:`core.cpu_threads.xla_pool_threads`). A no-op off glibc Linux, when opted out, or when
    the settings are already present (so it re-executes at most once). Call first thing in a
    launch script, before it changes the process's CPU affinity: the process image is replaced.
    """
    if not is_glibc_linux():
        return
    update = malloc_settings_update(os.environ, one_thread)
    if not update:
        return
    os.environ.update(update)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
