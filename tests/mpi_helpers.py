"""Shared by the level-2 tests (under ``mpirun``)."""

import time

from mpi4py import MPI


def from_rank_0(compute):
    """``compute()`` run on rank 0, its result on every rank. The others wait polling with
    sleeps: in ``bcast`` they would busy-wait and take the shared cores from rank 0's run. An
    error on rank 0 is raised on every rank."""
    comm, tag = MPI.COMM_WORLD, 31
    if comm.rank == 0:
        try:
            value = ("value", compute())
        except Exception as e:
            value = ("error", f"rank 0: {type(e).__name__}: {e}")
            raise
        finally:
            for rank in range(1, comm.size):
                comm.send(value, dest=rank, tag=tag)
        return value[1]
    while not comm.iprobe(source=0, tag=tag):
        time.sleep(0.05)
    kind, value = comm.recv(source=0, tag=tag)
    if kind == "error":
        raise RuntimeError(value)
    return value
