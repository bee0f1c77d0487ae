"""CPU cores and thread counts for processes that share a host.

``mpirun -n 8`` on an 8-core host starts 8 processes, and by default each XLA CPU client (and
each torch process) runs its intra-op work on *all* cores: 64 threads fighting over 8 cores,
with every collective waiting for the slowest, descheduled one. XLA's thread-pool flags
(``--xla_cpu_multi_thread_eigen=false``, ``intra_op_parallelism_threads``) are accepted but
do not limit the current CPU runtime (measured: a 2048^2 matmul runs at the same 2-core speed
with them). :func:`configure_cpu_threads` (called by the launch path before JAX starts its
backend) sets them anyway, with torch/OpenMP thread counts, to ``cores // local processes``,
and with ``MCJ_CPU_AFFINITY=1`` also pins each process to its own share of the cores: local
rank ``r`` of ``n`` gets cores ``[r*k, (r+1)*k)`` with ``k = cores // n``, or core
``r % cores`` when there are more processes than cores. Pinning is off by default because it
was measured to cost pipeline layouts up to 1.5x (an idle stage's core cannot help the busy
one) while changing data-parallel steps by less than the noise (README, end-to-end benchmark).
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


def configure_cpu_threads() -> int:
    """Size thread pools to this process's share of the cores and, with ``MCJ_CPU_AFFINITY=1``,
    pin it to :func:`cores_for_this_process` (call before JAX starts its backend). Returns the
    thread count for this process."""
    if local_process_count() <= 1:
        return available_cores()
    if os.environ.get("MCJ_CPU_AFFINITY", "0") == "1" and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores_for_this_process())
    return configure_xla_cpu_threads()


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
