"""Shared by the benchmarks: run a script under mpirun in worker mode and collect rank 0's rows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

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
    from core.runtime.cluster import initialize_distributed
    from core.runtime.cpu_threads import configure_cpu_threads, release_cpu_affinity

    configure_cpu_threads(share_pool=True)
    initialize_distributed()
    import jax

    jax.devices()
    release_cpu_affinity()


def write_processes_report(run, a, script: str, workload: str, title: str, reps: int, table: str,
                           one_process_out: str, stem: str) -> Path:
    """Rank 0 of a benchmark's ``mpirun`` mode: print ``workload`` and ``table`` and write them under
    ``run``'s header (a :class:`timing.BenchRun`) to ``a.out``, or to
    ``bench/results/<stem>_<platform>.md`` when ``a.out`` is the one-process report's default
    ``one_process_out``; ``title`` (lower case) names the table (``table`` may hold more tables
    under their own ``##`` headings). Written atomically. Returns the report's path."""
    import jax

    from core.atomic_files import write_text_atomically

    platform, processes = jax.devices()[0].platform, jax.process_count()
    rounds = f"rank 0, median of {reps} round-robin rounds"
    print(f"{workload}\n\n{title} ({rounds}; {run.lap()})\n\n{table}", flush=True)
    root = Path(__file__).resolve().parents[1]
    out = Path(a.out if str(a.out) != str(one_process_out) else root / "bench" / "results" / f"{stem}_{platform}.md")
    header = run.header(f"mpirun -n {processes} python bench/{script}{' --quick' if a.quick else ''}", a.machine,
                        a.note)
    heading = f"{title[0].upper()}{title[1:]} ({rounds})"
    write_text_atomically(out, f"{header}\n\nWorkload: {workload}.\n\n## {heading}\n\n{table}\n")
    print(f"\n{run.elapsed():.0f} s; wrote {out}")
    return out
