"""CPU thread counts for processes that share a host.

``mpirun -n 8`` on an 8-core host starts 8 processes, and by default each XLA CPU client (and
each torch process) sizes its intra-op thread pool to *all* cores: 64 threads fighting over 8
cores, with every collective waiting for the slowest, descheduled one. The launch path calls
:func:`configure_xla_cpu_threads` before JAX starts its backend, giving each process
``cores // local processes`` threads (and Eigen's single-threaded path when that is 1).
"""

from __future__ import annotations

import os

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


def configure_xla_cpu_threads() -> int:
    """Limit XLA's CPU intra-op threads to :func:`threads_per_process` (call before JAX's backend
    starts; a no-op when this is the only process on the host or ``XLA_FLAGS`` already sets it).
    Returns the thread count chosen."""
    threads = threads_per_process()
    flags = os.environ.get("XLA_FLAGS", "")
    if local_process_count() == 1 or "intra_op_parallelism_threads" in flags or "multi_thread_eigen" in flags:
        return threads
    extra = f"intra_op_parallelism_threads={threads}"
    if threads == 1:
        extra = "--xla_cpu_multi_thread_eigen=false " + extra
    os.environ["XLA_FLAGS"] = f"{flags} {extra}".strip()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    return threads
