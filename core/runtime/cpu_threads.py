"""CPU cores and thread counts for processes that share a host.

``mpirun -n 8`` on an 8-core host starts 8 processes, and by default each XLA CPU client (and
each torch process) runs its intra-op work on *all* cores: 64 threads fighting over 8 cores,
with every collective waiting for the slowest, descheduled one. XLA's thread-pool flags
(``--xla_cpu_multi_thread_eigen=false``) do not limit the current CPU runtime (a large matmul
still uses every core of the affinity mask with it), so none is set; XLA sizes its pool from
the process's CPU affinity mask when its backend starts. :func:`configure_cpu_threads` (called
by the launch path before JAX starts its backend, a no-op unless JAX will run on the CPU) sets
the OpenMP/BLAS thread counts to ``cores // local processes``, and:

* ``share_pool=True`` (the launch path's choice for layouts without pipeline parallelism):
  narrows the affinity mask to the process's share of the cores until the backend has started,
  then :func:`release_cpu_affinity` gives every thread the whole mask back. XLA's pool then
  has the share's size but its threads are not pinned (torch's ``set_num_threads``): the
  processes do not oversubscribe the cores, so data- and tensor-parallel steps run faster.
  Not for pipeline layouts: a stage idles in the bubbles and its neighbour's larger pool uses
  the idle core, so a pipeline step is faster with the full pool.
* ``MCJ_CPU_AFFINITY=1``: pins each process to its own share for good: local rank ``r`` of
  ``n`` gets cores ``[r*k, (r+1)*k)`` with ``k = cores // n``, or core ``r % cores`` when there
  are more processes than cores. Opt-in: it slows pipeline layouts down for the same reason.

Measurements: ``bench/results/2026-11-cpu-tuning.md`` (CPU threads).
"""

from __future__ import annotations

import os

from core.runtime.jax_backend import jax_runs_on_cpu

_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE",
                    "SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE")


def local_process_count() -> int:
    """Processes of this job on this host, from the launcher's environment (1 when unknown)."""
    for var in _LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_process() -> int:
    """This process's fair share of the host's cores (at least 1)."""
    return max(1, available_cores() // local_process_count())


def local_rank() -> int:
    """This process's rank among the job's processes on this host (0 when unknown)."""
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                "LOCAL_RANK"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def cores_for_this_process() -> list[int]:
    """The cores this process should run on: its share of the host's available cores."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(available_cores()))
    n, r = local_process_count(), local_rank()
    if n <= 1:
        return cores
    if n > len(cores):
        return [cores[r % len(cores)]]
    k = len(cores) // n
    return cores[r * k:(r + 1) * k]


_FULL_AFFINITY: set[int] | None = None
"""The affinity mask :func:`configure_cpu_threads` narrowed for ``share_pool`` (None: not narrowed)."""


def _pinned() -> bool:
    """Whether the user asked for pinning (``MCJ_CPU_AFFINITY=1``)."""
    return os.environ.get("MCJ_CPU_AFFINITY", "0") == "1"


def _narrows_affinity(share_pool: bool) -> bool:
    """Whether :func:`configure_cpu_threads` narrows this process's mask to its share before
    JAX's backend starts (pinned for good, or for ``share_pool`` until released)."""
    return local_process_count() > 1 and hasattr(os, "sched_setaffinity") and (_pinned() or share_pool)


def configure_cpu_threads(share_pool: bool = False) -> int:
    """Size thread pools to this process's share of the cores (call before JAX starts its
    backend; nothing changes when JAX will not run on the CPU). With ``MCJ_CPU_AFFINITY=1`` pin
    the process to :func:`cores_for_this_process`; else with ``share_pool`` narrow its affinity
    to them until :func:`release_cpu_affinity` (XLA sizes its pool from the mask when the
    backend starts). Returns the thread count."""
    if local_process_count() <= 1 or not jax_runs_on_cpu():
        return available_cores()
    threads = configure_library_threads()  # from the whole mask, before it is narrowed
    global _FULL_AFFINITY
    if _narrows_affinity(share_pool) and _FULL_AFFINITY is None:
        if not _pinned():  # share_pool: remember the whole mask to give back
            _FULL_AFFINITY = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cores_for_this_process())
    return threads


def release_cpu_affinity() -> None:
    """Give every thread of this process back the affinity mask ``share_pool`` narrowed (call once
    JAX's backend has started and sized its pool; a no-op otherwise)."""
    global _FULL_AFFINITY
    if _FULL_AFFINITY is None:
        return
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), _FULL_AFFINITY)
        except OSError:  # the thread exited meanwhile
            pass
    _FULL_AFFINITY = None


def configure_library_threads() -> int:
    """Set OpenMP/BLAS thread counts (``OMP_NUM_THREADS`` and friends, unless the user set them)
    to :func:`threads_per_process`; returns that count."""
    threads = threads_per_process()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    return threads
