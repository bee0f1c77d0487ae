"""glibc malloc settings for XLA's CPU runtime: huge pages, and freed memory kept for the next step.

XLA's CPU runtime allocates each step's large buffers with ``malloc``; glibc serves them with
``mmap`` and ``munmap``-s them on free, so every step page-faults its working set in again, 4 KiB
at a time, and spends a large share of its time in the kernel. The settings
(:data:`KEEP_FREED_TUNABLES` and :data:`XLA_HEAP_FLAG`):

* transparent huge pages (``hugetlb=1``: glibc ``madvise``-s its mappings);
* no ``mmap`` for large blocks and no trimming (``mmap_max=0``, a 64 GiB ``trim_threshold``), so
  a step's freed buffers stay in the process and the next step reuses them;
* each thread keeps its own arena. A thread arena grows in heaps of at most 64 MiB, and glibc
  ``mmap``-s any larger block whatever ``mmap_max`` says, so each device's temp block (hundreds
  of MB for a small GPT) would be mapped, zeroed by the kernel and unmapped every step.
  :data:`XLA_HEAP_FLAG` makes XLA split each program's temp into heaps of about 32 MiB (the same
  bytes in all; XLA's ``xla_multiheap_size_constraint_per_heap``), which fit in a thread arena's
  heaps, and a 64 MiB ``top_pad`` keeps glibc from deleting a heap that became all free: no
  faults and no system time per step, at the price of a higher peak memory (the arenas keep what
  they held).

Every process gets the same settings, whatever the size of its XLA thread pool: a single arena
(``arena_max=1``) for processes with a one-thread pool is slower at several processes and needs
more peak memory. Measurements: ``bench/results/2026-11-cpu-tuning.md`` (memory pages).

Tunables are only read at process start, so :func:`reexec_with_malloc_settings` re-executes the
interpreter once with them (first thing in a launch script, before MPI or JAX start) and adds
:data:`XLA_HEAP_FLAG` to ``XLA_FLAGS``. ``MCJ_MALLOC_TUNING=0`` opts out; a tunable or XLA flag
the user set keeps the user's value. Needs glibc >= 2.35 (and for the huge pages the kernel's
THP mode ``madvise`` or ``always``); elsewhere inert. Only for runs on JAX's CPU backend
(``core.runtime.jax_backend.jax_runs_on_cpu``, decided before JAX starts): a GPU run's host memory is
returned to the kernel as usual and XLA's GPU buffer assignment gets no heap-size constraint.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from core.runtime.jax_backend import jax_runs_on_cpu

KEEP_FREED_TUNABLES = (
    "glibc.malloc.hugetlb=1",  # transparent huge pages on malloc's memory
    "glibc.malloc.mmap_max=0",  # blocks come from the arenas' heaps and go back to them
    "glibc.malloc.trim_threshold=68719476736",  # and the heaps are not given back to the kernel
    "glibc.malloc.top_pad=67108864",  # not even a thread arena's heap that became all free
)
"""Tunables that keep what a step freed in the process, in every thread's arena (with
:data:`XLA_HEAP_FLAG`, every block fits in an arena's heap)."""

XLA_HEAP_FLAG = "--xla_multiheap_size_constraint_per_heap=33554432"
"""XLA flag: split each program's temp buffer into heaps of about 32 MiB (a thread arena's heap is 64 MiB)."""

CACHEABLE_RUN_ITERS = 200
"""Runs up to this many iterations skip the XLA heap flag when the compilation cache is on.

XLA cannot serialize a CPU program whose temp buffer is split into heaps ("Multiple temp buffer
allocations found", jaxlib 0.10.2 and 0.11.2), so with the flag a large training step is never
written to the persistent compilation cache, and every launch compiles it again in every
process. The split saves a little time per step, a warm cache the step's whole compile, so a
short run gains more from the cache and a long one from the split; this bound lies above the
iteration count where the two break even, so short runs (tests, smoke runs, quick experiments)
get cacheable programs and longer ones the faster steps (``bench/results/2026-11-startup-cpu.md``)."""

OPT_OUT_VAR = "MCJ_MALLOC_TUNING"
"""Set to ``0`` to skip the malloc settings."""


def malloc_settings_update(environ: Mapping[str, str], split_heaps: bool = True) -> dict[str, str]:
    """The ``GLIBC_TUNABLES`` / ``XLA_FLAGS`` update that adds the settings (the XLA heap flag only
    with ``split_heaps``); tunables and the XLA flag the user already set keep their value. Empty
    when nothing is missing or the user opted out."""
    if environ.get(OPT_OUT_VAR, "1") == "0":
        return {}
    update = {}
    current = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    present = {t.split("=", 1)[0] for t in current}
    missing = [t for t in KEEP_FREED_TUNABLES if t.split("=", 1)[0] not in present]
    if missing:
        update["GLIBC_TUNABLES"] = ":".join(current + missing)
    flags = environ.get("XLA_FLAGS", "")
    if split_heaps and XLA_HEAP_FLAG.split("=", 1)[0] not in flags:
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


def reexec_with_malloc_settings(split_heaps: bool = True) -> None:
    """Re-execute this Python process with the malloc settings added when a tunable is missing
    (the XLA heap flag only with ``split_heaps``: see :data:`CACHEABLE_RUN_ITERS`).

    A no-op off glibc Linux, when JAX will not run on the CPU, or when opted out; when only the
    XLA flag is missing it is set without a re-exec (XLA reads it when its backend starts), so the
    process re-executes at most once. Call first thing in a launch script, before JAX starts:
    the process image is replaced.
    """
    if not is_glibc_linux() or not jax_runs_on_cpu():
        return
    update = malloc_settings_update(os.environ, split_heaps)
    os.environ.update(update)
    if "GLIBC_TUNABLES" not in update:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
