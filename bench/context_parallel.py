"""Context parallelism: per-device attention memory and step time, the longest sequence within a
memory budget, load balance, how much of the ring's communication is hidden, and the memory of
the einsum blocks by query tile.

    python bench/context_parallel.py            # ~5 min on 2 cores (7-8 min with other jobs on them)
    python bench/context_parallel.py --quick    # tiny sizes, one rep, ~1 min (the test's smoke run)

One process, ``--devices`` simulated CPU devices; a mesh of the first ``cp`` with the axis
``"cp"``. The workload is one GPT-like causal self-attention, ``[batch, heads, seq, head_dim]``
float32 (default 1 x 8 x seq x 64: hidden 512), forward and backward jitted as one
``shard_map`` over cp: this rank's q, k, v and output cotangent in, its dq, dk, dv out, the
attention ``core.context_parallel.context_parallel_attention`` (load-balanced, causal). The
inputs are random, so they are not reordered: the order of the tokens changes no cost.

1. **cp = 1, 2, 4, 8 at ``--seq``**, ``p2p`` (ring), ``all_gather``, ``a2a`` (Ulysses: all-to-alls
   around the backend's attention on the whole sequence with heads / cp heads) and ``a2a+p2p``
   (all-to-all in groups of 2, the ring across cp / 2 groups), side by side: per-device memory from
   the compiled executable's ``memory_analysis()`` (arguments, outputs, temporaries; an SPMD
   program, so per device; *total* = arguments + outputs + temporaries - aliased), and the
   median step time (all of part 1's programs timed round-robin), and the bytes the forward
   saves for the backward (``jax.vjp``'s residuals: the attention's activations a model keeps per
   layer). Reference row: the model's attention without CP (``causal_attention``, on CPU the
   C++ flash kernel, whose scratch ``memory_analysis`` does not see). Target: <= 0.3x cp=1 of the
   same kernel at cp=4, reported for both the saved activations and the peak total.
2. **Sequence length** (``--seqs``, compiled only): the same per-device totals, and at each cp
   the longest sequence (a multiple of ``--granule``) whose total fits ``--budget-mib``: a
   quadratic fit of the grid's totals, checked by compiling at the pick and one granule above.
   It should grow ~linearly with cp for the ring (its blocks are ``(seq / 2cp)^2``); the
   all-gather holds the full K/V and its gradient buffer, so it grows less than linearly. On the
   CPU backend ``a2a`` at seq >= 16 x 16 runs the C++ flash kernel, whose scratch
   ``memory_analysis`` does not count (as the reference row's), so its totals are a lower bound.
3. **Load balance** at cp = ``--balance-cp``: block products per rank from
   ``block_products`` (exact), and per-rank step time: each rank's own workload (its schedule
   of the ring, its queries against the K/V blocks it computes, run alone on one device with
   the K/V hops no-ops: ``ring_attention``'s ``_isolated=(cp, rank)``), the ranks of each
   order timed round-robin in wall time and in this process's CPU time (which other jobs on a
   shared host inflate less); imbalance = max / min - 1 of the medians. Target <= 5%
   load-balanced.
4. **Communication hiding** (ring, ``--hide-cps``): round-robin medians of the ring step, the
   same step with every ``ppermute`` a no-op (``_isolated=(cp, None)``: each rank computes its
   own schedule with its local K/V), and the ring's hops alone (the same ``ppermute``s of K/V
   and of the dK/dV accumulators, no compute). Exposed = the median of the same-round
   differences ring - no-op (with their interquartile range: the host's noise); hidden share =
   1 - exposed / hops: 1 when the exchange is fully hidden behind the block products, 0 when it
   adds its full time.

Simulated devices share the host's cores, so step times show each device's work and how it
serialises, not a cluster's speed; the memory figures are what XLA assigns per device. Prints
the tables and writes ``bench/results/context_parallel_cpu.md`` (``--out``).

5. **Query tiles of the einsum blocks** (``--tile-seqs``, ``--tile-cps``, ``--tiles``; compiled
   only): per-device temporaries of the block products as they run on GPUs (XLA einsums;
   bfloat16 q/k/v, float32 scores), untiled and with ``_blocks.QUERY_TILE`` at each tile.

**Between processes** (``mpirun -n N python bench/context_parallel.py``): two tables at cp = N,
one device per process, the collectives real transfers between processes (gloo on the CPU,
NCCL on GPUs), each process on its share of the cores; rank 0's times, ``--hide-reps``
round-robin rounds each. Simulated devices cannot show hiding (a hop there is a copy on the
same threads as the compute) nor what an all-to-all costs between processes; this can.

* Part 4 (ring communication hiding) at cp = N.
* **Step time by comm type**: the ``p2p``, ``a2a`` and (N >= 4) ``a2a+p2p`` steps of part 1 at
  ``--seq``, with their per-device totals, and a local reference timed round-robin with them:
  ``causal_attention``'s forward and backward on each process's own device, no communication,
  on ``[batch, heads / N, seq, head_dim]`` (the full sequence with 1/N of the heads: the
  attention one Ulysses rank runs between its all-to-alls). Ratios: step / ``p2p`` (target for
  ``a2a``: <= 1) and step / reference (``a2a``'s is its attention compute plus its all-to-alls
  over that attention alone; within 1.1x, its attention compute is too).

Writes ``bench/results/context_parallel_processes_<platform>.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from mpi_launch import start_worker_process, write_processes_report  # noqa: E402
from timing import BenchRun, round_robin_medians, round_robin_times  # noqa: E402

from core.atomic_files import write_text_atomically  # noqa: E402

MIB = 1024 * 1024
COMM_TYPES = ("p2p", "all_gather")  # the blockwise kernels (part 5's einsum blocks)
COMPARED = COMM_TYPES + ("a2a", "a2a+p2p")  # parts 1 and 2: as core.context_parallel.COMM_TYPES (imported later)
A2A_GROUP = 2
"""``a2a+p2p``'s all-to-all group (``--hierarchical-context-parallel-sizes 2 cp/2``: the ring across
``cp / 2`` groups); at cp <= 2 it is ``a2a``."""
DEFAULT_OUT = str(ROOT / "bench" / "results" / "context_parallel_cpu.md")
TARGET_MEMORY_RATIO = 0.3
"""Target: attention memory per device at cp=4 over cp=1."""
TARGET_IMBALANCE = 0.05
"""Target: load-balanced per-rank step-time imbalance, max / min - 1."""
TARGET_A2A_COMPUTE = 1.1
"""Target between processes: the ``a2a`` step over one device's attention on the full sequence
with 1/cp of the heads (attention compute + all-to-alls: within it, the compute is too)."""


def hierarchical_sizes(comm_type: str, cp: int) -> tuple[int, int] | None:
    """The ``(a2a, ring)`` sizes the benchmark runs ``a2a+p2p`` with at ``cp`` (None for the other types)."""
    if comm_type != "a2a+p2p":
        return None
    a2a = min(A2A_GROUP, cp)
    return a2a, cp // a2a


def comm_label(comm_type: str, cp: int) -> str:
    """The table's name of a comm type at cp (``a2a+p2p`` with its sizes)."""
    sizes = hierarchical_sizes(comm_type, cp)
    return comm_type if sizes is None else f"{comm_type} {sizes[0]}x{sizes[1]}"


# -- the programs ------------------------------------------------------------------------------
def _mesh(cp: int) -> Any:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:cp]), ("cp",))


def _grads(attn: Callable[..., Any]) -> Callable[..., Any]:
    """``(q, k, v, w) -> (dq, dk, dv)`` of ``sum(attn(q, k, v) * w)``: one forward and backward."""
    import jax
    import jax.numpy as jnp

    def step(q, k, v, w):
        return jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    return step


def _over_cp(cp: int, local: Callable[..., Any]) -> Any:
    """``local(q, k, v, w) -> (dq, dk, dv)`` jitted as a ``shard_map`` over the sequence axis of cp devices."""
    import jax
    from jax.sharding import PartitionSpec as P

    spec = P(None, None, "cp", None)
    return jax.jit(jax.shard_map(local, mesh=_mesh(cp), in_specs=(spec,) * 4, out_specs=(spec,) * 3,
                                 check_vma=False))


def attention_step(cp: int, comm_type: str, no_hops: bool = False) -> Any:
    """The benchmarked step at cp: ``context_parallel_attention`` forward and backward; ``no_hops``
    (ring only): every K/V hop a no-op, each rank running its own schedule on its local K/V."""
    from core.context_parallel import context_parallel_attention, ring_attention
    from core.transformer.dot_product_attention import causal_attention

    if no_hops:
        attn = partial(ring_attention, _isolated=(cp, None))
    else:
        attn = partial(context_parallel_attention, comm_type=comm_type,
                       hierarchical_sizes=hierarchical_sizes(comm_type, cp), local_attention=causal_attention)
    return _over_cp(cp, _grads(attn))


def ring_hops(cp: int) -> Any:
    """The ring step's exchanges without its compute: forward ``cp - 1`` hops of (K, V); backward
    ``cp - 1`` hops of (K, V) and ``cp`` of the float32 dK/dV accumulators."""
    from jax import lax

    hop = partial(lax.ppermute, axis_name="cp", perm=[(i, (i + 1) % cp) for i in range(cp)])

    def local(q, k, v, w):
        fwd = lax.fori_loop(0, cp - 1, lambda _, kv: hop(kv), (k, v))
        bwd, dkv = lax.fori_loop(0, cp - 1, lambda _, c: (hop(c[0]), hop(c[1])), ((k, v), (k, v)))
        dk, dv = hop(dkv)
        return q, fwd[0] + bwd[0] + dk, fwd[1] + bwd[1] + dv
    return _over_cp(cp, local)


def reference_step() -> Any:
    """The model's attention without context parallelism (``causal_attention``), one device."""
    import jax

    from core.transformer.dot_product_attention import causal_attention

    return jax.jit(_grads(causal_attention))


def rank_workload(cp: int, rank: int, load_balanced: bool) -> Any:
    """Rank ``rank``'s share of the ring step at cp, alone on one device (hops no-ops)."""
    import jax

    from core.context_parallel import ring_attention

    return jax.jit(_grads(partial(ring_attention, load_balanced=load_balanced, _isolated=(cp, rank))))


def compile_for(fn: Any, shape: tuple[int, ...], dtype: str = "float32") -> Any:
    """``fn`` compiled for four ``shape`` arguments of ``dtype`` (global shapes for a ``shard_map``)."""
    import jax

    return fn.lower(*(jax.ShapeDtypeStruct(shape, dtype),) * 4).compile()


def saved_for_backward(cp: int, comm_type: str, shape: tuple[int, ...]) -> int:
    """Per-device bytes the attention's forward keeps for its backward at cp (the residuals of
    ``jax.vjp``, counted while tracing the ``shard_map``): its share of the activations a model
    stores per layer until the backward, as against the transient peak of one forward and
    backward that :func:`memory` reads."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from core.context_parallel import context_parallel_attention
    from core.transformer.dot_product_attention import causal_attention

    attn = partial(context_parallel_attention, comm_type=comm_type,
                   hierarchical_sizes=hierarchical_sizes(comm_type, cp), local_attention=causal_attention)
    counted = []

    def local(q, k, v):
        residuals = {id(x): x for x in jax.tree.leaves(jax.vjp(attn, q, k, v)[1])}.values()
        counted.append(sum(math.prod(x.shape) * x.dtype.itemsize for x in residuals))
        return q

    spec = P(None, None, "cp", None)
    jax.eval_shape(jax.shard_map(local, mesh=_mesh(cp), in_specs=(spec,) * 3, out_specs=spec, check_vma=False),
                   *(jax.ShapeDtypeStruct(shape, jnp.float32),) * 3)
    return counted[0]


def memory(compiled: Any) -> dict[str, int]:
    """Per-device bytes of a compiled executable: arguments, outputs, temporaries and their total."""
    m = compiled.memory_analysis()
    args, out, temp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
    return {"args": args, "out": out, "temp": temp, "total": args + out + temp - m.alias_size_in_bytes}


def inputs_for(compiled: Any, shape: tuple[int, ...]) -> list[Any]:
    """Random float32 q, k, v, w of the global ``shape``, placed as ``compiled`` takes them (each
    process builds the same host values and places its own shards: also between processes)."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    values = [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]
    return [jax.make_array_from_callback(shape, sharding, lambda index, x=x: x[index])
            for x, sharding in zip(values, compiled.input_shardings[0])]


class Programs:
    """Compiled attention steps by (comm type, cp, seq), each compiled once (memory and timing)."""

    def __init__(self, batch: int, heads: int, head_dim: int):
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        self._compiled: dict[tuple[str, int, int], Any] = {}

    def shape(self, seq: int) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, seq, self.head_dim)

    def step(self, comm_type: str, cp: int, seq: int) -> Any:
        key = (comm_type, cp, seq)
        if key not in self._compiled:
            self._compiled[key] = compile_for(attention_step(cp, comm_type), self.shape(seq))
        return self._compiled[key]

    def total(self, comm_type: str, cp: int, seq: int) -> int:
        return memory(self.step(comm_type, cp, seq))["total"]


# -- the parts ---------------------------------------------------------------------------------
def cp_rows(programs: Programs, seq: int, cps: Sequence[int], reps: int) -> list[dict[str, Any]]:
    """Part 1: per-device memory and median step time (all programs timed round-robin) by comm type
    and cp at ``seq``, and the reference."""
    import jax

    from core.transformer.dot_product_attention import attention_implementation

    shape = programs.shape(seq)
    x = jax.ShapeDtypeStruct(shape, "float32")
    cases = [(comm, cp, programs.step(comm, cp, seq)) for comm in COMPARED for cp in cps]
    cases.append((f"none: `causal_attention` ({attention_implementation(x, x, x)})", 1,
                  compile_for(reference_step(), shape)))
    times = round_robin_medians([partial(c, *inputs_for(c, shape)) for _, _, c in cases], reps=reps)
    rows = [{"comm": comm, "cp": cp, **memory(c), "step_s": t,
             "saved": saved_for_backward(cp, comm, shape) if comm in COMPARED else math.nan}
            for (comm, cp, c), (t,) in zip(cases, times)]
    for row in rows:
        one = [r for r in rows if r["comm"] == row["comm"] and r["cp"] == 1]
        row["ratio"] = row["total"] / one[0]["total"] if row["comm"] in COMPARED else math.nan
        row["saved_ratio"] = row["saved"] / one[0]["saved"] if row["comm"] in COMPARED else math.nan
    return rows


def longest_within(total_at: Callable[[int], int], seqs: Sequence[int], budget: float, granule: int,
                   max_seq: int = 1 << 21) -> tuple[int, bool]:
    """The longest multiple of ``granule`` (up to ``max_seq``) whose ``total_at(seq)`` fits ``budget``
    bytes, and whether it was confirmed (the next multiple does not fit). Starts from a quadratic
    fit of the totals at ``seqs`` (relative residuals; the flash kernel's totals are about linear,
    so the fit's root can lie far out or nowhere: the guess is clamped), then brackets the
    boundary with steps doubling from one granule and bisects it."""
    import numpy as np

    fits = lambda seq: total_at(seq) <= budget
    totals = np.array([total_at(s) for s in seqs], dtype=float)
    coef = np.polyfit(np.array(seqs, dtype=float), totals, min(2, len(seqs) - 1), w=1 / totals)
    coef[-1] -= budget  # the fit's roots are where it crosses the budget
    roots = [r.real for r in np.roots(coef) if abs(r.imag) < 1e-9 and r.real > 0]
    guess = int(min(max(roots, default=max(seqs)), max_seq) // granule) * granule
    guess = max(granule, guess)
    if not fits(guess):  # bracket [lo fits, hi does not] around the guess, steps doubling
        hi, step = guess, granule
        lo = guess - step
        while lo > granule and not fits(lo):
            hi, step = lo, step * 2
            lo = max(granule, hi - step)
        if not fits(lo):
            return 0, True
    else:
        lo, step = guess, granule
        while True:
            if lo >= max_seq:
                return lo, False
            hi = min(max_seq, lo + step)
            if not fits(hi):
                break
            lo, step = hi, step * 2
    while hi - lo > granule:  # bisect on multiples of the granule
        mid = (lo + hi) // 2 // granule * granule
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, True


def seq_rows(programs: Programs, seqs: Sequence[int], cps: Sequence[int], budget: float, granule: int
             ) -> tuple[dict[tuple[str, int, int], int], list[dict[str, Any]]]:
    """Part 2: per-device totals on the grid, and the longest sequence within ``budget`` per comm type and cp."""
    grid = {(comm, cp, seq): programs.total(comm, cp, seq) for comm in COMPARED for cp in cps for seq in seqs}
    longest = []
    for comm in COMPARED:
        for cp in cps:
            seq, confirmed = longest_within(partial(programs.total, comm, cp), seqs, budget, granule)
            longest.append({"comm": comm, "cp": cp, "seq": seq, "confirmed": confirmed,
                            "total": programs.total(comm, cp, seq) if seq else 0})
    for row in longest:
        base = next(r["seq"] for r in longest if r["comm"] == row["comm"] and r["cp"] == 1)
        row["growth"] = row["seq"] / base if base else float("nan")
    return grid, longest


def balance_rows(programs: Programs, seq: int, cp: int, reps: int) -> list[dict[str, Any]]:
    """Part 3: per-rank block products and isolated per-rank step time, load-balanced and contiguous."""
    from core.context_parallel import block_products

    shape = programs.shape(seq // cp)
    rows = []
    for lb in (True, False):  # each order's ranks timed together, round-robin
        ranks = [compile_for(rank_workload(cp, r, lb), shape) for r in range(cp)]
        args = inputs_for(ranks[0], shape)
        # The contiguous order's spread (cp x) needs a quarter of the rounds the balanced one's needs.
        times = round_robin_medians([partial(c, *args) for c in ranks], reps=reps if lb else max(1, reps // 4),
                                    clocks=(time.perf_counter, time.process_time))
        wall, cpu = zip(*times)
        counts = block_products(cp, load_balanced=lb)
        rows.append({"load_balanced": lb, "chunk": seq // (2 * cp if lb else cp), "products": counts,
                     "products_imbalance": max(counts) / min(counts) - 1,
                     "times_s": list(wall), "imbalance": max(wall) / min(wall) - 1,
                     "cpu_s": list(cpu), "cpu_imbalance": max(cpu) / min(cpu) - 1})
    return rows


def hiding_rows(programs: Programs, seq: int, cps: Sequence[int], reps: int) -> list[dict[str, Any]]:
    """Part 4: ring step vs the same with no-op hops vs the hops alone, and the hidden share."""
    shape = programs.shape(seq)
    rows = []
    for cp in cps:
        ring = programs.step("p2p", cp, seq)
        no_hops = compile_for(attention_step(cp, "p2p", no_hops=True), shape)
        hops = compile_for(ring_hops(cp), shape)
        args = inputs_for(ring, shape)
        [ring_ts], [none_ts], [hops_ts] = round_robin_times([partial(f, *args) for f in (ring, no_hops, hops)],
                                                            reps=reps)
        # The exposed time is the median of same-round differences (a slow spell of the host hits
        # both); their interquartile range says how far the host's noise lets it be read.
        diffs = [r - n for r, n in zip(ring_ts, none_ts)]
        q1, _, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (math.nan,) * 3
        exposed, t_hops = statistics.median(diffs), statistics.median(hops_ts)
        rows.append({"cp": cp, "ring_s": statistics.median(ring_ts), "no_hops_s": statistics.median(none_ts),
                     "exposed_s": exposed, "exposed_iqr_s": (q1, q3), "hops_s": t_hops,
                     "hidden": 1 - exposed / t_hops})
    return rows


def local_reference(shape: tuple[int, ...]) -> Any:
    """:func:`reference_step` compiled for this process's own device (no communication)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    x = jax.ShapeDtypeStruct(shape, "float32", sharding=SingleDeviceSharding(jax.local_devices()[0]))
    return reference_step().lower(*(x,) * 4).compile()


def comm_rows(programs: Programs, seq: int, cp: int, reps: int) -> list[dict[str, Any]]:
    """Between processes: the ``p2p``, ``a2a`` and (cp >= 4) ``a2a+p2p`` steps at cp and the local
    reference (the full sequence with heads / cp heads on each process's device), timed round-robin."""
    import jax

    from core.transformer.dot_product_attention import attention_implementation

    shape = programs.shape(seq)
    ref_shape = (programs.batch, programs.heads // cp, seq, programs.head_dim)
    comms = ["p2p", "a2a"] + (["a2a+p2p"] if cp >= 4 else [])
    steps = [programs.step(comm, cp, seq) for comm in comms]
    ref = local_reference(ref_shape)
    impl = attention_implementation(*(jax.ShapeDtypeStruct(ref_shape, "float32"),) * 3)
    fns = [partial(c, *inputs_for(c, shape)) for c in steps] + [partial(ref, *inputs_for(ref, ref_shape))]
    times = [t for (t,) in round_robin_medians(fns, reps=reps)]
    rows = [{"comm": comm, "label": comm_label(comm, cp), "cp": cp, "total": memory(c)["total"], "step_s": t}
            for comm, c, t in zip(comms, steps, times)]
    rows.append({"comm": "reference", "cp": 1, "total": None, "step_s": times[-1],
                 "label": f"reference: `causal_attention` ({impl}), {ref_shape[1]} head{'s' * (ref_shape[1] > 1)}, "
                          "one device"})
    for row in rows:
        row["vs_p2p"], row["vs_reference"] = row["step_s"] / times[0], row["step_s"] / times[-1]
    return rows


def tiling_rows(programs: Programs, seqs: Sequence[int], cps: Sequence[int], tiles: Sequence[int]
                ) -> list[dict[str, Any]]:
    """Part 5: per-device temporaries of the einsum block products (GPU's path: bfloat16 q/k/v,
    float32 scores) by query tile (``_blocks.QUERY_TILE``; 0: untiled), compiled only."""
    from core.context_parallel import _blocks

    default, rows = _blocks.QUERY_TILE, []
    try:
        for seq in seqs:
            for cp in cps:
                for comm in COMM_TYPES:
                    row = {"seq": seq, "cp": cp, "comm": comm, "temp": {}}
                    for tile in tiles:
                        _blocks.QUERY_TILE = tile or seq  # a tile of the whole chunk: untiled
                        step = compile_for(attention_step(cp, comm), programs.shape(seq), "bfloat16")
                        row["temp"][tile] = memory(step)["temp"]
                    rows.append(row)
    finally:
        _blocks.QUERY_TILE = default
    return rows


# -- the tables --------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def cp_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| attention | cp | arguments MiB | outputs MiB | temporaries MiB | total MiB | total / cp=1 "
             "| saved for backward MiB | saved / cp=1 | step ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio, saved_ratio = ("" if math.isnan(r[key]) else f"{r[key]:.3f}" for key in ("ratio", "saved_ratio"))
        saved = "" if math.isnan(r["saved"]) else _mib(r["saved"])
        lines.append(f"| {comm_label(r['comm'], r['cp'])} | {r['cp']} | {_mib(r['args'])} | {_mib(r['out'])} | "
                     f"{_mib(r['temp'])} | "
                     f"{_mib(r['total'])} | {ratio} | {saved} | {saved_ratio} | {r['step_s'] * 1e3:.1f} |")
    return "\n".join(lines)


def memory_target(rows: list[dict[str, Any]], cp: int = 4, key: str = "ratio") -> tuple[dict[str, float], bool]:
    """``key`` (``"ratio"``: the peak total; ``"saved_ratio"``: the activations saved for the
    backward) at ``cp`` over cp=1 per comm type, and whether every one is within the target."""
    ratios = {r["comm"]: r[key] for r in rows if r["cp"] == cp and r["comm"] in COMPARED}
    return ratios, bool(ratios) and all(x <= TARGET_MEMORY_RATIO for x in ratios.values())


def seq_table(grid: dict[tuple[str, int, int], int], seqs: Sequence[int], cps: Sequence[int]) -> str:
    cols = [(comm, cp) for comm in COMPARED for cp in cps]
    lines = ["| seq | " + " | ".join(f"{comm_label(comm, cp)} cp={cp}" for comm, cp in cols) + " |",
             "|---|" + "---|" * len(cols)]
    lines += [f"| {seq} | " + " | ".join(_mib(grid[(comm, cp, seq)]) for comm, cp in cols) + " |" for seq in seqs]
    return "\n".join(lines)


def longest_table(rows: list[dict[str, Any]], budget: float) -> str:
    lines = [f"| attention | cp | longest seq within {budget / MIB:.0f} MiB | its total MiB | x cp=1 | x cp=1 / cp |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        seq = f"{r['seq']}" if r["confirmed"] else f">= {r['seq']}"
        lines.append(f"| {comm_label(r['comm'], r['cp'])} | {r['cp']} | {seq} | {_mib(r['total'])} | "
                     f"{r['growth']:.2f} | {r['growth'] / r['cp']:.2f} |")
    return "\n".join(lines)


def tiling_table(rows: list[dict[str, Any]], tiles: Sequence[int]) -> str:
    heads = " | ".join("untiled" if t == 0 else f"tiles of {t}" for t in tiles)
    lines = [f"| seq | cp | attention | {heads} |", "|---|---|---|" + "---|" * len(tiles)]
    lines += [f"| {r['seq']} | {r['cp']} | {r['comm']} | " + " | ".join(_mib(r["temp"][t]) for t in tiles) + " |"
              for r in rows]
    return "\n".join(lines)


def balance_table(rows: list[dict[str, Any]]) -> str:
    cp = len(rows[0]["products"])
    lines = ["| order | chunk | " + " | ".join(f"rank {r}" for r in range(cp)) + " | max / min - 1 |",
             "|---|---|" + "---|" * (cp + 1)]
    for r in rows:
        name = "load-balanced" if r["load_balanced"] else "contiguous"
        lines.append(f"| {name}: block products | {r['chunk']} | " + " | ".join(map(str, r["products"]))
                     + f" | {r['products_imbalance']:.2f} |")
        for what, key in (("wall", "times_s"), ("CPU", "cpu_s")):
            ts = r[key]
            lines.append(f"| {name}: rank's step, {what} ms | {r['chunk']} | "
                         + " | ".join(f"{t * 1e3:.1f}" for t in ts) + f" | {100 * (max(ts) / min(ts) - 1):.1f}% |")
    return "\n".join(lines)


def hiding_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| cp | ring ms | same, hops no-ops ms | exposed ms | exposed, IQR ms | hops alone ms | hidden share |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['cp']} | {r['ring_s'] * 1e3:.1f} | {r['no_hops_s'] * 1e3:.1f} | {r['exposed_s'] * 1e3:.1f} | "
              f"{r['exposed_iqr_s'][0] * 1e3:.1f} .. {r['exposed_iqr_s'][1] * 1e3:.1f} | {r['hops_s'] * 1e3:.1f} | "
              f"{100 * r['hidden']:.0f}% |" for r in rows]
    return "\n".join(lines)


def comm_table(rows: list[dict[str, Any]]) -> str:
    """The step-time-by-comm-type table between processes (rows of :func:`comm_rows`)."""
    lines = ["| attention | cp | per-device total MiB | step ms | step / p2p | step / reference |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['cp']} | {'' if r['total'] is None else _mib(r['total'])} | "
              f"{r['step_s'] * 1e3:.1f} | {r['vs_p2p']:.3f} | {r['vs_reference']:.3f} |" for r in rows]
    return "\n".join(lines)


def comm_verdict(rows: list[dict[str, Any]], within: float = TARGET_A2A_COMPUTE) -> str:
    """The comm table's note: ``a2a`` against ``p2p`` (target <= 1) and against the reference (<= ``within``)."""
    a2a = next(r for r in rows if r["comm"] == "a2a")
    compute = ("so its attention compute is too" if a2a["vs_reference"] <= within else
               "NOT within (this does not separate the attention compute from the all-to-alls)")
    return (f"`a2a` step / `p2p` step **{a2a['vs_p2p']:.3f}** (target <= 1: "
            f"{'met' if a2a['vs_p2p'] <= 1 else 'NOT met'}). `a2a` step (attention compute + all-to-alls) / one "
            f"device's attention over the full sequence with 1/{a2a['cp']} of the heads **{a2a['vs_reference']:.3f}**: "
            f"{'within' if a2a['vs_reference'] <= within else 'over'} {within}x, {compute}.")


# -- the command -------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one rep (a smoke run)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=2048, help="sequence length of parts 1, 3 and 4")
    p.add_argument("--cps", default="1,2,4,8", help="context-parallel sizes of parts 1 and 2")
    p.add_argument("--seqs", default="2048,4096,8192,16384,32768", help="part 2's sequence lengths (compiled only)")
    p.add_argument("--budget-mib", type=float, default=512.0, help="part 2's per-device memory budget")
    p.add_argument("--granule", type=int, default=256, help="part 2's longest sequences are multiples of this")
    p.add_argument("--balance-cp", type=int, default=4, help="part 3's context-parallel size")
    p.add_argument("--hide-cps", default="2,4,8", help="part 4's context-parallel sizes")
    p.add_argument("--reps", type=int, default=3, help="round-robin rounds of part 1 (median, after one warm-up)")
    p.add_argument("--balance-reps", type=int, default=41,
                   help="round-robin rounds of part 3, load-balanced (median; contiguous: a quarter)")
    p.add_argument("--hide-reps", type=int, default=7,
                   help="round-robin rounds of part 4 (median; under mpirun also of the step time by comm type)")
    p.add_argument("--tile-seqs", default="8192,16384", help="part 5's sequence lengths (compiled only)")
    p.add_argument("--tile-cps", default="2,4", help="part 5's context-parallel sizes")
    p.add_argument("--tiles", default="0,1024,512", help="part 5's query tiles (0: untiled)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="the report (under mpirun: bench/results/context_parallel_processes_<platform>.md)")
    p.add_argument("--machine", default="2-core AVX2 VM (AMD EPYC)",
                   help="the machine, for the report")
    p.add_argument("--note", default="", help="a note for the report (e.g. other jobs on the cores)")
    a = p.parse_args(argv)
    if a.quick:
        a.heads, a.head_dim, a.seq, a.cps, a.seqs = 4, 16, 256, "1,4", "256,512"  # a2a at cp 4: 4 heads
        a.budget_mib, a.granule, a.balance_cp, a.hide_cps = 1.0, 32, 2, "2"
        a.tile_seqs, a.tile_cps, a.tiles = "256", "2", "0,32"
        a.reps = a.balance_reps = a.hide_reps = 1
    cps = _ints(a.cps) + [a.balance_cp] + _ints(a.hide_cps) + _ints(a.tile_cps)
    for seq in [a.seq, a.granule, *_ints(a.seqs), *_ints(a.tile_seqs)]:
        if seq % (2 * max(cps)):
            p.error(f"sequence length {seq} must split into 2 x cp = {2 * max(cps)} chunks")
    if a.heads % max(_ints(a.cps)):
        p.error(f"--heads {a.heads} must divide by the largest cp {max(_ints(a.cps))} (a2a splits the heads)")
    if 1 not in _ints(a.cps):
        p.error("--cps must include 1 (the memory ratios and growth are against it)")
    return a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the four parts, print the tables, write the report; returns the figures."""
    a = _args(argv)
    import jax

    cps, hide_cps, seqs = _ints(a.cps), _ints(a.hide_cps), _ints(a.seqs)
    need = max(cps + hide_cps + [a.balance_cp])
    if jax.device_count() < need:
        raise SystemExit(f"needs {need} devices, JAX has {jax.device_count()} (run as a script, or set "
                         f"JAX_NUM_CPU_DEVICES)")
    run = BenchRun()
    programs = Programs(a.batch, a.heads, a.head_dim)
    budget = a.budget_mib * MIB
    workload = (f"causal self-attention forward + backward, batch {a.batch} x {a.heads} heads x head dim "
                f"{a.head_dim}, float32, load-balanced order, {jax.device_count()} simulated "
                f"{jax.devices()[0].platform} devices in one process")
    print(workload, flush=True)

    cp = cp_rows(programs, a.seq, cps, a.reps)
    ratios, met = memory_target(cp)
    saved_ratios, saved_met = memory_target(cp, key="saved_ratio")
    cp_text = (f"{cp_table(cp)}\n\nPer device at cp=4 over cp=1 (same kernel; target <= {TARGET_MEMORY_RATIO}): "
               "activations saved for the backward "
               + ", ".join(f"{comm} **{x:.3f}**" for comm, x in saved_ratios.items())
               + f" ({'met' if saved_met else 'NOT met'}); peak total of one forward + backward "
               + ", ".join(f"{comm} **{x:.3f}**" for comm, x in ratios.items())
               + f" ({'met' if met else 'NOT met'})")
    print(f"\n1. seq {a.seq}, cp = {a.cps} (median of {a.reps} round-robin rounds; {run.lap()})\n\n{cp_text}",
          flush=True)

    grid, longest = seq_rows(programs, seqs, cps, budget, a.granule)
    seq_text = f"{seq_table(grid, seqs, cps)}\n\n{longest_table(longest, budget)}"
    print(f"\n2. per-device total MiB vs sequence length; longest within {a.budget_mib:.0f} MiB ({run.lap()})\n\n"
          f"{seq_text}", flush=True)

    balance = balance_rows(programs, a.seq, a.balance_cp, a.balance_reps)
    balanced = next(r for r in balance if r["load_balanced"])
    verdict = {key: "met" if balanced[key] <= TARGET_IMBALANCE else "NOT met" for key in ("imbalance", "cpu_imbalance")}
    bal_text = (f"{balance_table(balance)}\n\nLoad-balanced: block products equal "
                f"{'yes' if balanced['products_imbalance'] == 0 else 'NO'}; step-time imbalance "
                f"(target <= {100 * TARGET_IMBALANCE:.0f}%) **{100 * balanced['imbalance']:.1f}%** wall "
                f"({verdict['imbalance']}), **{100 * balanced['cpu_imbalance']:.1f}%** CPU time "
                f"({verdict['cpu_imbalance']})")
    print(f"\n3. load balance, seq {a.seq}, cp {a.balance_cp} (median of {a.balance_reps} round-robin rounds, "
          f"contiguous {max(1, a.balance_reps // 4)}; {run.lap()})\n\n{bal_text}", flush=True)

    hiding = hiding_rows(programs, a.seq, hide_cps, a.hide_reps)
    hide_text = hiding_table(hiding)
    print(f"\n4. ring communication hidden, seq {a.seq} (median of {a.hide_reps} round-robin rounds; {run.lap()})\n\n"
          f"{hide_text}", flush=True)

    tiles = _ints(a.tiles)
    tiling = tiling_rows(programs, _ints(a.tile_seqs), _ints(a.tile_cps), tiles)
    tile_text = tiling_table(tiling, tiles)
    print(f"\n5. einsum blocks (GPU's path: bfloat16 q/k/v, float32 scores), per-device temporaries MiB by "
          f"query tile ({run.lap()})\n\n{tile_text}", flush=True)

    header = (run.header(f"python bench/context_parallel.py{' --quick' if a.quick else ''}", a.machine, a.note)
              + f"\n\nWorkload: {workload}.\n")
    report = (f"{header}\n## 1. Memory and step time vs cp (seq {a.seq}, median of {a.reps} round-robin rounds)\n\n"
              f"{cp_text}\n\n"
              f"## 2. Per-device total MiB vs sequence length (compiled only); longest sequence within "
              f"{a.budget_mib:.0f} MiB (multiples of {a.granule})\n\n{seq_text}\n\n"
              f"## 3. Load balance (seq {a.seq}, cp {a.balance_cp}; each rank's workload alone on one device, "
              f"median of {a.balance_reps} round-robin rounds, contiguous {max(1, a.balance_reps // 4)})\n\n"
              f"{bal_text}\n\n"
              f"## 4. Ring communication hidden (seq {a.seq}, median of {a.hide_reps} round-robin rounds)\n\n"
              f"{hide_text}\n\n"
              f"## 5. Einsum blocks (GPU's path: bfloat16 q/k/v, float32 scores): per-device temporaries MiB by "
              f"query tile (compiled only)\n\n{tile_text}\n")
    write_text_atomically(a.out, report)
    print(f"\n{run.elapsed():.0f} s; wrote {a.out}")
    return {"cp": cp, "memory_ratios": ratios, "saved_ratios": saved_ratios, "grid": grid, "longest": longest,
            "balance": balance, "hiding": hiding, "tiling": tiling}


def processes_main(argv: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Under ``mpirun -n N``: part 4 and the step time by comm type between N processes (cp = N);
    rank 0 prints the tables and writes the report. Returns ``{"hiding": rows, "comm": rows}``
    (every rank). Call after ``jax.distributed`` has started."""
    a = _args(argv)
    import jax

    cp = jax.process_count()
    if jax.device_count() != cp or a.seq % (2 * cp) or a.heads % cp:
        raise SystemExit(f"needs one device per process, --seq divisible by 2 x {cp} and --heads by {cp}: got "
                         f"{jax.device_count()} devices in {cp} processes, --seq {a.seq}, --heads {a.heads}")
    run = BenchRun()
    programs = Programs(a.batch, a.heads, a.head_dim)
    rows = {"hiding": hiding_rows(programs, a.seq, [cp], a.hide_reps),
            "comm": comm_rows(programs, a.seq, cp, a.hide_reps)}
    if jax.process_index() == 0:
        platform = jax.devices()[0].platform
        workload = (f"causal self-attention forward + backward, batch {a.batch} x {a.heads} heads x head dim "
                    f"{a.head_dim}, seq {a.seq}, float32, {cp} processes, one {platform} device each")
        tables = (f"{hiding_table(rows['hiding'])}\n\n## Step time by comm type between processes (rank 0, median "
                  f"of {a.hide_reps} round-robin rounds; the reference on each process's own device, no "
                  f"communication)\n\n{comm_table(rows['comm'])}\n\n{comm_verdict(rows['comm'])}")
        write_processes_report(run, a, "context_parallel.py", workload, "ring communication hidden between processes",
                               a.hide_reps, tables, DEFAULT_OUT, "context_parallel_processes")
    return rows


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    from core.parallel_state import mpi_world_size_from_env

    if mpi_world_size_from_env() > 1:
        start_worker_process()
        processes_main()
        sys.exit(0)
    from core.runtime.cpu_devices import configure_cpu_devices
    from core.runtime.cpu_malloc import reexec_with_malloc_settings

    # The launch path's malloc settings (freed buffers kept, not page-faulted in again every call);
    # no XLA heap split, so memory_analysis() sees the default buffer assignment.
    reexec_with_malloc_settings(split_heaps=False)
    configure_cpu_devices(_args(sys.argv[1:]).devices)
    main()
