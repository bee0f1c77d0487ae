"""Starting ``jax.distributed`` under an MPI launcher, on one host or many.

``mpirun``/``srun`` start the processes; mpi4py tells each its rank, the world size, and which
ranks share its host. From that, :func:`initialize_distributed` decides, on every rank alike:

* **the coordinator**: ``JAX_COORDINATOR_ADDRESS`` (``host:port``) when set; else rank 0's host
  name (``JAX_COORDINATOR_IP`` overrides it) and ``JAX_COORDINATOR_PORT`` or a port free on rank
  0 (JAX's own mpi4py detection derives a fixed port from the host name, so two jobs on one
  host collide);
* **the devices each process drives** (:func:`choose_local_device_ids`): ``JAX_LOCAL_DEVICE_IDS``
  when set; all visible devices when the process is alone on its host (one process driving
  all its GPUs) or when its host's ranks were given different ``CUDA_VISIBLE_DEVICES`` (SLURM's
  ``--gpus-per-task=1``, wrapper scripts); otherwise the visible GPUs split evenly over the
  host's ranks in local-rank order (``mpirun -n 8`` on an 8-GPU host: one each). JAX's own
  detection always assigns device ``local_rank``, which breaks both of the first two cases;
* **the host of every process** (:func:`process_host_index`), which ``parallel_state`` uses to
  keep tensor-parallel groups inside a host.

On the CPU backend it also keeps gloo's ``[Gloo] Rank 0 is connected to ...`` lines out of
standard output (:mod:`core.runtime.gloo_chatter`; ``MCJ_GLOO_LOGS=1`` keeps them).

Problems (GPUs that do not split over the ranks, ranks that drive different device counts)
raise :class:`ClusterError` with the numbers on every rank, before anything waits for a rank
that will never come.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

from core.runtime.gloo_chatter import filter_gloo_chatter
from core.runtime.jax_backend import jax_runs_on_cpu, visible_nvidia_gpus

MPI_WORLD_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
"""Environment variables that MPI launchers set to the number of ranks in the job."""

INITIALIZATION_TIMEOUT_S = 300
"""How long ``jax.distributed.initialize`` waits for every process to connect."""

_PROCESS_HOSTS: list[int] | None = None
"""Host index of each process (by process id), once :func:`initialize_distributed` has run."""


class ClusterError(RuntimeError):
    """The processes cannot form one JAX job as launched (reported as one line on every rank)."""


def mpi_world_size_from_env() -> int:
    """Number of ranks an MPI launcher started, from its environment (1 when not under MPI)."""
    for var in MPI_WORLD_SIZE_VARS:
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
"""Environment variables that MPI launchers (and SLURM) set to this process's rank."""


def mpi_rank_and_world_from_env() -> tuple[int, int]:
    """``(this process's rank, world size)`` from the launcher's environment, without an MPI call
    (``(0, 1)`` when not under a launcher): what a launcher script needs before it starts MPI."""
    world = mpi_world_size_from_env()
    for var in MPI_RANK_VARS:
        if var in os.environ:
            return int(os.environ[var]), world
    return 0, world


def choose_local_device_ids(local_rank: int, local_size: int, visible_per_local_rank: Sequence[str | None],
                            environ: Mapping[str, str] | None = None) -> list[int] | None:
    """The device ids (indices among the visible GPUs) this process should drive, or None for
    every device it sees; see the module docstring for the rules.

    ``visible_per_local_rank`` is ``CUDA_VISIBLE_DEVICES`` (None when unset) of each rank on
    this host, in local-rank order. Raises :class:`ClusterError` when the host's GPUs do not
    split evenly over its ranks.
    """
    environ = os.environ if environ is None else environ
    if environ.get("JAX_LOCAL_DEVICE_IDS", "").strip():
        return [int(x) for x in environ["JAX_LOCAL_DEVICE_IDS"].split(",")]
    if local_size == 1 or len(set(visible_per_local_rank)) > 1 or jax_runs_on_cpu(environ):
        return None
    gpus = visible_nvidia_gpus(environ)
    if gpus == 0:
        return None
    if gpus % local_size:
        raise ClusterError(
            f"{local_size} processes on host {socket.gethostname()} cannot split its {gpus} visible GPUs evenly; "
            "launch one process per GPU (or one per host), or give each rank its devices with CUDA_VISIBLE_DEVICES "
            "or JAX_LOCAL_DEVICE_IDS")
    per_process = gpus // local_size
    return list(range(local_rank * per_process, (local_rank + 1) * per_process))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def coordinator_address(rank: int, environ: Mapping[str, str] | None = None) -> str | None:
    """``host:port`` of the coordinator as rank ``rank`` proposes it (only rank 0's proposal is
    used; others return None unless ``JAX_COORDINATOR_ADDRESS`` fixes it for everyone)."""
    environ = os.environ if environ is None else environ
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return environ["JAX_COORDINATOR_ADDRESS"]
    if rank != 0:
        return None
    host = environ.get("JAX_COORDINATOR_IP") or socket.gethostname()
    return f"{host}:{environ.get('JAX_COORDINATOR_PORT') or _free_port()}"


def host_indices(hostnames: Sequence[str]) -> list[int]:
    """Each process's host as an index, numbered in order of first appearance by process id."""
    index: dict[str, int] = {}
    return [index.setdefault(h, len(index)) for h in hostnames]


def process_host_index(process_index: int) -> int:
    """The host of process ``process_index`` as an index (hosts numbered by their first process);
    the process index itself when the hosts are unknown (``jax.distributed`` started elsewhere),
    so each process is then taken for its own host."""
    return process_index if _PROCESS_HOSTS is None else _PROCESS_HOSTS[process_index]


def _fail_together(comm, message: str | None) -> None:
    """Raise :class:`ClusterError` on every rank when any rank has a message (collective)."""
    messages = comm.allgather(message)
    bad = [(r, m) for r, m in enumerate(messages) if m]
    if bad:
        rank, first = bad[0]
        raise ClusterError(first if len(bad) == len(messages) else f"rank {rank}: {first}")


def initialize_distributed() -> None:
    """Initialise ``jax.distributed`` for this MPI job (see the module docstring).

    A no-op when it is already initialised or when running as a single process. Must run
    before anything starts JAX's backend (``jax.devices()``, creating arrays).
    """
    import jax

    global _PROCESS_HOSTS
    if jax.distributed.is_initialized() or mpi_world_size_from_env() <= 1:
        return
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    visible = local.allgather(os.environ.get("CUDA_VISIBLE_DEVICES"))
    ids, problem = None, None
    try:
        ids = choose_local_device_ids(local.Get_rank(), local.Get_size(), visible)
    except (ClusterError, ValueError) as err:
        problem = str(err)
    _fail_together(comm, problem)
    address = comm.bcast(coordinator_address(comm.Get_rank()), root=0)
    try:
        jax.distributed.initialize(address, comm.Get_size(), comm.Get_rank(), ids,
                                   cluster_detection_method="deactivate",
                                   initialization_timeout=INITIALIZATION_TIMEOUT_S)
    except RuntimeError as err:
        raise ClusterError(
            "jax.distributed could not be initialised for this mpirun job. It must happen before any other "
            "JAX call touches the devices (jax.devices(), creating arrays, ...): call "
            "core.parallel_state.initialize_model_parallel() or initialize_distributed() first. "
            f"JAX said: {err}") from err
    if jax_runs_on_cpu():  # gloo's collectives: their connection lines stay off stdout
        filter_gloo_chatter()
    _PROCESS_HOSTS = host_indices(comm.allgather(socket.gethostname()))
    counts = comm.allgather(jax.local_device_count())
    if len(set(counts)) > 1:
        raise ClusterError(f"processes drive different numbers of devices ({_describe_counts(counts)}); every "
                           "process must drive as many devices as the others: check CUDA_VISIBLE_DEVICES and "
                           "JAX_LOCAL_DEVICE_IDS on each host")


def _describe_counts(counts: Sequence[int]) -> str:
    by_count: dict[int, list[int]] = {}
    for rank, n in enumerate(counts):
        by_count.setdefault(n, []).append(rank)
    return ", ".join(f"{n} on rank{'s' if len(r) > 1 else ''} {_ranges(r)}" for n, r in sorted(by_count.items()))


def _ranges(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)) \
        else ",".join(map(str, ranks))
