"""Shared by the benchmarks: run a script under mpirun in worker mode and collect rank 0's rows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROW = "ROW "


def emit(row: dict) -> None:
    """Print one result row (call on rank 0 only)."""
    print(ROW + json.dumps(row), flush=True)


def free_port() -> int:
    """A TCP port nothing listens on now, for a launch's torch rendezvous (``MASTER_PORT``): a
    fixed port can still be held by the previous launch."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script: str, world: int, worker_args: list[str], timeout: int) -> list[dict]:
    """``mpirun -n world python script worker_args``; returns the rows rank 0 emitted."""
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["MASTER_PORT"] = str(free_port())  # a torch worker's rendezvous, fresh per launch
    cmd = ["mpirun", "--oversubscribe", "-n", str(world), sys.executable, os.path.abspath(script), *worker_args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        sys.exit(f"worker failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line[len(ROW):]) for line in proc.stdout.splitlines() if line.startswith(ROW)]


def start_worker_process() -> None:
    """Start this ``mpirun`` rank as the launch path does: on the CPU each process's thread pool
    sized to its share of the cores, ``jax.distributed`` up, the backend started (it sizes its
    pool then), the CPU affinity released."""
    from core.cluster import initialize_distributed
    from core.cpu_threads import configure_cpu_threads, release_cpu_affinity

    configure_cpu_threads(share_pool=True)
    initialize_distributed()
    import jax

    jax.devices()
    release_cpu_affinity()
