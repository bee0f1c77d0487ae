"""Collective times and bandwidths over the mesh, and the gloo reduce-scatter stall.

    python bench/collectives.py                       # world sizes 2, 4, 8; 1 KiB .. 64 MiB
    python bench/collectives.py --world-sizes 8 --sizes 1K,1M --reps 3

The driver launches ``mpirun -n W`` of this file in worker mode for each world size and
prints one Markdown table per part:

1. all-reduce (``psum``), all-gather, and reduce-scatter three ways (raw ``psum_scatter``,
   the package's ring, all-reduce + slice), each op measured stand-alone: a warm-up call,
   then the median of ``--reps`` calls. ``size`` is the full per-rank buffer (all-reduce
   input, reduce-scatter input, all-gather output); bus bandwidth follows nccl-tests
   (all-reduce x 2(n-1)/n, the others x (n-1)/n). Raw ``psum_scatter`` runs last, largest
   first, so its stall cannot slow the other rows.
2. The stall: a 4 MiB all-reduce alone, after a small raw ``psum_scatter``, and after a small
   ring reduce-scatter, each in a fresh set of processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpi_launch import emit, launch  # noqa: E402
from timing import median_seconds  # noqa: E402

from core.atomic_files import write_text_atomically  # noqa: E402

STALL_SEQUENCES = {
    "all-reduce 4 MiB alone": ["ar:1048576"],
    "raw psum_scatter 1 KiB, then all-reduce 4 MiB": ["rs_raw:256", "ar:1048576"],
    "ring reduce-scatter 1 KiB, then all-reduce 4 MiB": ["rs_ring:256", "ar:1048576"],
    "raw psum_scatter 1 KiB, then all-gather 4 MiB": ["rs_raw:256", "ag:1048576"],
}


def parse_size(text: str) -> int:
    """'64K' / '4M' / '1024' -> bytes."""
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}
    return int(float(text[:-1]) * mult[text[-1].upper()]) if text[-1].upper() in mult else int(text)


def human(nbytes: int) -> str:
    """Bytes as KiB/MiB."""
    return f"{nbytes // 1024**2} MiB" if nbytes >= 1024**2 else f"{nbytes // 1024} KiB"


# ----------------------------------------------------------------------------- worker


def _worker_ops():
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps
    from core.distributed.collectives import reduce_scatter

    state = ps.initialize_model_parallel()
    axis = state.data_parallel_axis_name
    names = state.mesh.axis_names
    bodies = {
        "ar": lambda x: lax.psum(x, axis),
        "ag": lambda x: lax.all_gather(x, axis, tiled=True),
        "rs_raw": lambda x: reduce_scatter(x, axis, impl="psum_scatter"),
        "rs_ring": lambda x: reduce_scatter(x, axis, impl="ring"),
        "rs_allreduce": lambda x: reduce_scatter(x, axis, impl="all_reduce"),
    }

    def compile_op(op):
        def f(v):
            out = bodies[op](v.reshape(v.shape[-1]))
            return out.reshape((1,) * len(names) + out.shape)

        return jax.jit(jax.shard_map(f, mesh=state.mesh, in_specs=P(*names), out_specs=P(*names), check_vma=False))

    return state, {op: compile_op(op) for op in bodies}


def _input(state, numel: int):
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    names = state.mesh.axis_names
    local = np.ones((1,) * len(names) + (numel,), np.float32)
    return jax.make_array_from_process_local_data(jax.NamedSharding(state.mesh, P(*names)), local)


def worker_table(sizes: list[int], reps: int) -> None:
    """Measure every op at every size; rank 0 prints one JSON row per measurement."""
    import jax

    state, ops = _worker_ops()
    n = state.world_size
    plan = [(op, s) for op in ("ar", "ag", "rs_ring", "rs_allreduce") for s in sizes]
    plan += [("rs_raw", s) for s in sorted(sizes, reverse=True)]
    for op, size in plan:
        numel = size // 4
        if op == "ag":
            numel //= n  # all-gather input is the per-rank shard of the `size` output
        seconds = median_seconds(ops[op], _input(state, numel), reps=reps)
        if jax.process_index() == 0:
            emit({"world": n, "op": op, "bytes": size, "seconds": seconds})


def worker_sequence(steps: list[str], reps: int) -> None:
    """Run ``op:numel`` steps in order in this fresh process set; rank 0 prints each time."""
    import jax

    state, ops = _worker_ops()
    for step in steps:
        op, numel = step.split(":")
        seconds = median_seconds(ops[op], _input(state, int(numel)), reps=reps)
        if jax.process_index() == 0:
            emit({"world": state.world_size, "step": step, "seconds": seconds})


# ----------------------------------------------------------------------------- driver


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor."""
    return 2 * (n - 1) / n if op == "ar" else (n - 1) / n


def print_tables(rows: list[dict], stall_rows: dict[tuple[int, str], list[dict]]) -> None:
    """Markdown tables: per-size times/bus bandwidths, then the stall."""
    print("| world | size | all-reduce ms (busbw GB/s) | all-gather ms (busbw) | reduce-scatter: psum_scatter ms "
          "| ring ms | all-reduce+slice ms | ring / psum_scatter |")
    print("|---|---|---|---|---|---|---|---|")
    table = {(r["world"], r["bytes"], r["op"]): r["seconds"] for r in rows}
    for world, size in sorted({(r["world"], r["bytes"]) for r in rows}):
        def cell(op, world=world, size=size):
            t = table[(world, size, op)]
            return f"{t * 1e3:.2f} ({size / t * bus_factor(op, world) / 1e9:.2f})"

        raw, ring, ar_slice = (table[(world, size, op)] for op in ("rs_raw", "rs_ring", "rs_allreduce"))
        print(f"| {world} | {human(size)} | {cell('ar')} | {cell('ag')} | {raw * 1e3:.2f} | {ring * 1e3:.2f} "
              f"| {ar_slice * 1e3:.2f} | {ring / raw:.2f} |")
    print()
    print("| world | sequence (fresh processes) | time of the last step, s |")
    print("|---|---|---|")
    for (world, name), result in sorted(stall_rows.items()):
        print(f"| {world} | {name} | {result[-1]['seconds']:.3f} |")


def main() -> None:
    """Parse flags; run as driver or worker."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4,8")
    p.add_argument("--sizes", default="1K,4K,16K,64K,256K,1M,4M,16M,64M")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="also write all rows to this file")
    p.add_argument("--no-stall", action="store_true", help="skip the stall part")
    p.add_argument("--worker", choices=["table", "sequence"], help=argparse.SUPPRESS)
    p.add_argument("--steps", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker == "table":
        return worker_table(sizes, args.reps)
    if args.worker == "sequence":
        return worker_sequence(args.steps.split(","), args.reps)
    rows, stall_rows = [], {}
    for world in (int(w) for w in args.world_sizes.split(",")):
        rows += launch(__file__, world, ["--worker", "table", "--sizes", args.sizes, "--reps", str(args.reps)], 1800)
        if not args.no_stall:
            for name, steps in STALL_SEQUENCES.items():
                stall_rows[(world, name)] = launch(__file__, world, ["--worker", "sequence", "--steps", ",".join(steps),
                                                           "--reps", "1"], 600)
    print_tables(rows, stall_rows)
    if args.json:
        write_text_atomically(args.json, json.dumps(
            {"table": rows, "stall": {f"{w}|{n}": r for (w, n), r in stall_rows.items()}}, indent=1))


if __name__ == "__main__":
    main()
