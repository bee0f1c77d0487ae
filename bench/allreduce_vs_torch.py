"""The gradient all-reduce on CPU: JAX's gloo (``lax.psum``), the package's ``all_reduce`` and torch's gloo.

    python bench/allreduce_vs_torch.py                  # world sizes 2, 4, 8; 4 and 13 MiB
    python bench/allreduce_vs_torch.py --world-sizes 8 --sizes 13M --reps 20

Both JAX and torch link gloo and run its ring all-reduce over TCP, so on a host with a core per
process they take the same time; the question this answers is what each costs when processes
share cores (``mpirun --oversubscribe``), where a collective is bound by the CPU time the
processes spend in it. Per world size and buffer size, each implementation runs in its own
``mpirun`` launch (one process per rank, one thread each): a warm-up, then ``--reps`` timed
calls, each after a barrier so every rank starts together. Reported: the median wall time on
rank 0 and the CPU time (user + system, from ``getrusage``) the process spent per call,
barrier included. ``package`` is :func:`core.distributed.collectives.all_reduce` with its
default choice (ring reduce-scatter + all-gather from 4 MiB on a multi-process CPU run).
Needs torch (the ``bench`` extra) for the torch column.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collectives import human, parse_size  # noqa: E402
from mpi_launch import emit, launch  # noqa: E402

IMPLS = ("psum", "package", "torch")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(call, barrier, reps: int) -> tuple[float, float]:
    """(median wall seconds, CPU seconds per call) of ``call()`` over ``reps`` barrier-aligned calls."""
    call()
    times, cpu0 = [], _cpu_seconds()
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (_cpu_seconds() - cpu0) / reps


def _jax_calls(impl: str, numel: int):
    """(all-reduce call, barrier) for the JAX implementations, one device per process."""
    from core.runtime.cpu_threads import configure_cpu_threads, release_cpu_affinity

    configure_cpu_threads(share_pool=True)  # the launch path's thread pool of the process's share
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from core.distributed.collectives import all_reduce
    from core.parallel_state import initialize_distributed

    initialize_distributed()
    release_cpu_affinity()
    mesh = jax.make_mesh((jax.device_count(),), ("dp",))

    def program(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), check_vma=False))

    def as_global(local):
        return jax.make_array_from_process_local_data(NamedSharding(mesh, P("dp")), local)

    body = (lambda x: lax.psum(x, "dp")) if impl == "psum" else (lambda x: all_reduce(x, "dp"))
    reduce, sync = program(body), program(lambda x: lax.psum(x, "dp"))
    x, token = as_global(np.ones((numel,), np.float32)), as_global(np.ones((1,), np.float32))
    return (lambda: jax.block_until_ready(reduce(x))), (lambda: jax.block_until_ready(sync(token)))


def _torch_calls(numel: int):
    """(all-reduce call, barrier) with ``torch.distributed`` on gloo, one thread per process."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=int(os.environ["OMPI_COMM_WORLD_RANK"]),
                            world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
    x = torch.ones(numel)
    return (lambda: dist.all_reduce(x)), dist.barrier


def worker(impl: str, nbytes: int, reps: int) -> None:
    """One implementation at one size; rank 0 emits the row."""
    numel = nbytes // 4
    call, barrier = _torch_calls(numel) if impl == "torch" else _jax_calls(impl, numel)
    seconds, cpu = _measure(call, barrier, reps)
    if int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == 0:
        emit({"impl": impl, "bytes": nbytes, "world": int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")),
              "seconds": seconds, "cpu_seconds": cpu})


def _ratio(row: dict | None, torch_row: dict | None) -> str:
    """``row``'s wall time over torch's, or "-" when either is missing."""
    return f"{row['seconds'] / torch_row['seconds']:.2f}x" if row and torch_row else "-"


def print_table(rows: list[dict]) -> None:
    """Markdown: per world size and buffer, each implementation's wall and CPU ms, and the ratios."""
    got = {(r["world"], r["bytes"], r["impl"]): r for r in rows}
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    head = " | ".join(f"{i} ms (CPU ms)" for i in impls)
    print(f"| processes | size | {head} | psum / torch | package / torch |")
    print("|---|---|" + "---|" * (len(impls) + 2))
    for world, nbytes in sorted({(r["world"], r["bytes"]) for r in rows}):
        cells = [got.get((world, nbytes, i)) for i in impls]
        text = " | ".join(f"{c['seconds'] * 1e3:.1f} ({c['cpu_seconds'] * 1e3:.1f})" if c else "-" for c in cells)
        torch_row = got.get((world, nbytes, "torch"))
        ratios = [_ratio(got.get((world, nbytes, impl)), torch_row) for impl in ("psum", "package")]
        print(f"| {world} | {human(nbytes)} | {text} | {ratios[0]} | {ratios[1]} |")


def main() -> None:
    """Parse flags; run as driver (launches the workers, prints the table) or as a worker."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4,8")
    p.add_argument("--sizes", default="4M,13M")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.bytes, args.reps)
    try:
        import torch  # noqa: F401
        impls = IMPLS
    except ImportError:
        print("torch is not installed (pip install -e '.[bench]'): JAX columns only", file=sys.stderr)
        impls = IMPLS[:2]
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        for size in (parse_size(s) for s in args.sizes.split(",")):
            for impl in impls:
                rows += launch(__file__, world, ["--worker", impl, "--bytes", str(size), "--reps", str(args.reps)], 600)
    print_table(rows)


if __name__ == "__main__":
    main()
