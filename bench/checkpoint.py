"""Checkpoint cost: save and load time and size vs model size, and the step-time stall of a save.

    python bench/checkpoint.py            # ~5 min on 2 cores (quiet)
    python bench/checkpoint.py --quick    # tiny sizes, ~1 min
    python bench/checkpoint.py --gpu --devices 1   # on a GPU host (bench/gpu.py --checkpoint runs it)

For each model (the ``launch/pretrain.py`` default, then wider ones), one process trains with
``Pretrainer`` at tp=pp=1 over ``--devices`` CPU devices with the distributed optimizer (the
optimizer state is then stored sharded and gathered into the layout-independent form on save),
and measures, side by side in one run:

* **size**: parameters, parameters + Adam state (bytes), and the checkpoint on disk;
* **save**: a synchronous ``Pretrainer.save`` (gather, write, commit, integrity record), median
  of ``--reps``;
* **load**: ``Pretrainer.load`` into a fresh trainer of the same layout (restore into the
  shardings and re-cut the distributed optimizer's shards), median of ``--reps``;
* **async stall**: ``--steps`` training steps with an async save issued before them, minus the
  same steps without a save in the same round (median over ``--reps`` alternated rounds), as a share of one
  step: the time the training loop loses to a background save (the blocking part, which
  dispatches the gather and an on-device copy, plus the slowdown of the steps that share the
  cores with the writer). Measured side by side for the writer process (the default of
  ``--async-save``) and the writer thread (``--async-save-writer thread``, which also shares the
  GIL), the thread again with a 0.5 ms GIL switch interval (Python's default is 5 ms: the loop
  waits up to that long each time it needs the GIL while the writer holds it); on a GPU also the
  writer process with its device-to-host copies into pageable memory instead of pinned (the
  default there, as orbax's). The blocking part is reported too. ``--trace-dir`` traces one
  more async save (writer process) of the first model and its steps;
* **memory per device** (XLA's ``memory_analysis``, deterministic): the distributed optimizer's
  state, the save's copy and its program's temporaries, a load's temporaries, and the whole
  optimizer state for scale (``--devices 8`` for dp 8).

Prints a table and writes ``bench/results/checkpoint.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from core.atomic_files import write_text_atomically  # noqa: E402

MIB = 1024 * 1024


def _trainer(model_flags: list[str], devices: int, extra: list[str]) -> Any:
    import jax

    from core import parallel_state as ps
    from core.training.arguments import parse_args, validate_args
    from core.training.pretrainer import Pretrainer
    from core.training.run_config import pretrain_config

    args = parse_args([*model_flags, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                       "--use-distributed-optimizer", "--train-iters", "1000", "--eval-interval", "100000",
                       "--no-progress-bar", *extra])
    layout = validate_args(args, devices)
    state = ps.build_parallel_state(1, 1, devices=jax.devices()[:devices])
    return Pretrainer(pretrain_config(args), layout, state)


def _one_core_pool() -> None:
    """Start JAX's CPU backend with a one-core affinity mask (XLA sizes its pool from it), then
    give the process its cores back: the steps use about one core, the writer the others."""
    import jax

    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    jax.devices()
    os.sched_setaffinity(0, cores)


def _disk_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory) for f in fs)


def _steps(trainer: Any, n: int) -> float:
    import jax

    start = time.perf_counter()
    pending = [trainer.dispatch_step() for _ in range(n)]
    jax.block_until_ready([p["loss"] for p in pending])
    return time.perf_counter() - start


def _async_stall(trainer: Any, saver: Any, steps: int) -> tuple[float, float]:
    """``(blocking, blocking + steps)`` seconds of an async save of ``trainer`` by ``saver`` (a
    ``CheckpointSaver``) followed by ``steps`` training steps (the save is waited for
    afterwards, untimed)."""
    saver.wait()
    start = time.perf_counter()
    state, meta = trainer.checkpointer.checkpoint_state(trainer.training_state())
    saver.save(trainer.iteration, state, meta, copy=False)  # as Pretrainer.save
    blocking = time.perf_counter() - start
    total = blocking + _steps(trainer, steps)
    saver.wait()
    return blocking, total


FAST_SWITCH_S = 0.0005
"""The GIL switch interval of the ``fast_switch`` rows (Python's default: 0.005 s): a thread
waiting for the GIL waits up to the interval for the holder (here the writer) to drop it."""


def measure(model_flags: list[str], devices: int, steps: int, reps: int, workdir: str,
            trace_dir: str | None = None, one_copy: bool = False) -> dict[str, Any]:
    """One model's row (see the module docstring); with ``trace_dir`` one more async save (the
    writer process) and its steps are traced there (``jax.profiler``) after the timed rounds.

    ``one_copy``: :func:`measure_one_copy` instead."""
    import jax

    from core.checkpointing import CheckpointSaver

    if one_copy:
        return measure_one_copy(model_flags, devices, steps, workdir)
    keep = 2
    trainer = _trainer(model_flags, devices, [])
    _steps(trainer, 2)  # compile
    sync_dir = os.path.join(workdir, "sync")
    trainer.checkpointer._saver = CheckpointSaver(sync_dir, max_to_keep=keep, async_save=False)
    trainer.save(sync_dir)  # compiles the gather program
    # On a GPU also the writer process without pinned host staging (its device-to-host copies
    # into pageable memory), side by side: the default there stages them, as orbax does.
    writers = ("process", "thread") + (("pageable",) if jax.default_backend() == "gpu" else ())
    savers = {w: CheckpointSaver(os.path.join(workdir, w), max_to_keep=keep, async_save=True,
                                 writer="process" if w == "pageable" else w,
                                 pinned_host_transfer=False if w == "pageable" else None)
              for w in writers}
    for saver in savers.values():  # starts the writer process (its first save waits for it)
        _async_stall(trainer, saver, 1)
    saves, loads, plain = [], [], []
    stalls: dict[str, list[float]] = {"process": [], "thread": [], "fast": [], "pageable": []}
    blocking: dict[str, list[float]] = {"process": [], "thread": [], "pageable": []}
    phases: dict[str, list[dict[str, float]]] = {"process": [], "pageable": []}  # timed in the training process
    loader = _trainer(model_flags, devices, [])
    loader.load(sync_dir)  # compiles the re-cut program
    for _ in range(reps):
        _steps(trainer, 1)
        start = time.perf_counter()
        trainer.save(sync_dir)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        loader.load(sync_dir)
        jax.block_until_ready(loader.opt_state)
        loads.append(time.perf_counter() - start)
        # Alternate: steps alone, then an async save followed by the same number of steps, by
        # the writer process, by the writer thread, and by the thread with a short GIL switch interval.
        plain.append(_steps(trainer, steps))
        for writer in writers:
            block, total = _async_stall(trainer, savers[writer], steps)
            blocking[writer].append(block)
            stalls[writer].append(total)
        for writer in set(writers) & set(phases):
            phases[writer].append(savers[writer].write_phases)
        default_interval = sys.getswitchinterval()
        sys.setswitchinterval(FAST_SWITCH_S)
        try:
            stalls["fast"].append(_async_stall(trainer, savers["thread"], steps)[1])
        finally:
            sys.setswitchinterval(default_interval)
    if trace_dir is not None:
        import jax.profiler

        with jax.profiler.trace(trace_dir):
            _async_stall(trainer, savers["process"], steps)
    for saver in savers.values():
        saver.close()
    step = statistics.median(plain) / steps
    # Each round's save-and-steps minus the same round's plain steps: drift between rounds cancels.
    share = lambda totals: statistics.median(t - p for t, p in zip(totals, plain)) / step if totals else None
    ms = lambda times: statistics.median(times) * 1e3 if times else None
    size = _disk_bytes(os.path.join(sync_dir, str(max(int(d) for d in os.listdir(sync_dir) if d.isdigit()))))
    shutil.rmtree(workdir, ignore_errors=True)
    return {**memory(trainer, loader), **_sizes(trainer), "model": trainer.config.describe(), "disk_mib": size / MIB,
            "save_s": statistics.median(saves),
            "load_s": statistics.median(loads),
            "step_ms": step * 1e3, "blocking_ms": ms(blocking["process"]), "blocking_ms_thread": ms(blocking["thread"]),
            "stall_share": share(stalls["process"]), "stall_share_thread": share(stalls["thread"]),
            "stall_share_thread_fast_switch": share(stalls["fast"]), "stall_share_pageable": share(stalls["pageable"]),
            "writer_phases_ms": {k: statistics.median(p[k] for p in phases["process"]) * 1e3 for k in PHASES},
            "writer_phases_ms_pageable": {k: statistics.median(p[k] for p in phases["pageable"]) * 1e3
                                          for k in PHASES} if phases["pageable"] else None}


def measure_one_copy(model_flags: list[str], devices: int, steps: int, workdir: str) -> dict[str, Any]:
    """:func:`measure`'s row for a model of which the device holds one training state only
    (``bench/gpu.py``'s ~1.2B GPT on one GPU: ~20 GB of params, grads and Adam, plus the save's
    copy), at the least time and disk (each checkpoint is ~14.5 GB): one
    synchronous save, loaded back into the training model itself (once to compile, once timed),
    then deleted; the writer process started by one async save, then one timed async save followed
    by ``steps`` steps against the same steps alone. Three writes, at most two checkpoints on
    disk at once; each phase is printed as it ends (a run cut short by a timeout keeps what ran)."""
    import jax

    from core.checkpointing import CheckpointSaver

    started = time.perf_counter()
    log = lambda what: print(f"  [{time.perf_counter() - started:.0f} s] {what}", flush=True)
    trainer = _trainer(model_flags, devices, [])
    _steps(trainer, 2)  # compile
    jax.block_until_ready(trainer.checkpointer.checkpoint_state(trainer.training_state())[0])  # compile the copy
    log("trainer built, step and save copy compiled")
    sync_dir = os.path.join(workdir, "sync")
    trainer.checkpointer._saver = CheckpointSaver(sync_dir, max_to_keep=1, async_save=False)
    start = time.perf_counter()
    trainer.save(sync_dir)
    save = time.perf_counter() - start
    size = _disk_bytes(os.path.join(sync_dir, str(trainer.iteration)))
    log(f"synchronous save {save:.1f} s, {size / 2**30:.1f} GiB")
    trainer.load(sync_dir)  # compiles the re-cut program
    start = time.perf_counter()
    trainer.load(sync_dir)
    jax.block_until_ready(trainer.opt_state)
    load = time.perf_counter() - start
    log(f"load {load:.1f} s")
    shutil.rmtree(sync_dir)
    saver = CheckpointSaver(os.path.join(workdir, "async"), max_to_keep=1, async_save=True, writer="process")
    _async_stall(trainer, saver, 1)  # starts the writer process (its first save waits for it)
    log("writer process started (one async save)")
    plain = _steps(trainer, steps)
    blocking, total = _async_stall(trainer, saver, steps)
    phases = saver.write_phases
    saver.close()
    log(f"async save: blocking {blocking * 1e3:.1f} ms, {steps} steps {plain:.2f} s alone, {total:.2f} s after it")
    step = plain / steps
    return {**memory(trainer, trainer), **_sizes(trainer), "model": trainer.config.describe(), "disk_mib": size / MIB,
            "save_s": save, "load_s": load, "step_ms": step * 1e3, "blocking_ms": blocking * 1e3,
            "blocking_ms_thread": None, "stall_share": (total - plain) / step, "stall_share_thread": None,
            "stall_share_thread_fast_switch": None, "stall_share_pageable": None,
            "writer_phases_ms": {k: phases[k] * 1e3 for k in PHASES}, "writer_phases_ms_pageable": None}


def _sizes(trainer: Any) -> dict[str, float]:
    """``params`` (count) and ``state_mib`` (params + the optimizer state's global form)."""
    import jax
    import numpy as np

    state = sum(x.nbytes for x in jax.tree.leaves(trainer.params)) + sum(
        x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(trainer.optimizer.global_state_abstract()))
    return {"params": sum(x.size for x in jax.tree.leaves(trainer.params)), "state_mib": state / MIB}


PHASES = ("plan", "snapshot", "to_host", "shared_buffer", "writer", "thread_cpu")
"""``CheckpointSaver.write_phases``' keys, in the order of :func:`phases_table`'s columns."""


def phases_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the writer process's saves on the training process's side (median
    ms per phase): the background thread's work, which a dispatch-bound loop may feel."""
    lines = ["| model | describe the state | wait for the snapshot | device to host | into the shared buffer "
             "| writer: write and commit | the thread's CPU time |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for label, p in ((r["model"], r["writer_phases_ms"]),
                         (f"{r['model']}, pageable", r.get("writer_phases_ms_pageable"))):
            if p is not None:
                lines.append(f"| {label} | " + " | ".join(f"{p[k]:.2f} ms" for k in PHASES) + " |")
    return "\n".join(lines)


def memory(trainer: Any, loader: Any) -> dict[str, float]:
    """Per device (MiB, XLA's ``memory_analysis`` of the compiled programs, nothing run): the
    distributed optimizer's own state, the save's copy (its outputs: params + the optimizer
    state's global form, split over dp) and the temporaries of ``trainer``'s program that makes
    it, the temporaries of ``loader``'s conversion back into the optimizer's shards (after a
    load), and the whole optimizer state (what every rank would hold converting whole buckets at
    once)."""
    import jax
    import numpy as np

    device = trainer.ddp.mesh.devices.flat[0]
    on_device = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
                                 if s.device == device)
    checkpointer = trainer.checkpointer
    copy = checkpointer._checkpoint_copy or checkpointer._make_checkpoint_copy(trainer.training_state())
    copy = copy.lower(trainer.params, trainer.opt_state, trainer.model_state).compile().memory_analysis()
    target = loader.optimizer.global_state_abstract()
    load = loader.optimizer.conversion_program("from_global").lower(target).compile().memory_analysis()
    return {"opt_shard_mib": on_device(trainer.opt_state) / MIB, "copy_mib": copy.output_size_in_bytes / MIB,
            "copy_temp_mib": copy.temp_size_in_bytes / MIB, "load_temp_mib": load.temp_size_in_bytes / MIB,
            "whole_opt_mib": sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(target)) / MIB,
            "dp": trainer.layout.data_parallel_size}


def memory_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`memory`'s part of the rows."""
    lines = ["| model | dp | distributed optimizer state | save's copy | its program's temporaries "
             "| load's temporaries | whole optimizer state |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dp']} | {r['opt_shard_mib']:.2f} MiB | {r['copy_mib']:.2f} MiB "
                     f"| {r['copy_temp_mib']:.2f} MiB | {r['load_temp_mib']:.2f} MiB | {r['whole_opt_mib']:.2f} MiB |")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`measure`'s rows ("-": not measured, ``one_copy``)."""
    pct = lambda x: "-" if x is None else f"{x:.0%}"
    num = lambda x: "-" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.2f}"
    lines = ["| model | params | params + Adam | on disk | save (sync) | load | step | async save: blocking "
             "(process / thread) | async stall / step: writer process | writer thread | thread, GIL switch 0.5 ms "
             "| writer process, pageable copies (GPU) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['state_mib']:.1f} MiB | {r['disk_mib']:.1f} MiB "
                     f"| {r['save_s']:.2f} s | {r['load_s']:.2f} s | {r['step_ms']:.0f} ms "
                     f"| {num(r['blocking_ms'])} / {num(r['blocking_ms_thread'])} ms | {pct(r['stall_share'])} "
                     f"| {pct(r['stall_share_thread'])} | {pct(r['stall_share_thread_fast_switch'])} "
                     f"| {pct(r.get('stall_share_pageable'))} |")
    return "\n".join(lines)


MODELS = [[], ["--hidden-size", "256", "--num-attention-heads", "8"],
          ["--hidden-size", "512", "--num-attention-heads", "8"]]
QUICK_MODELS = [["--num-layers", "1", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
                 "--global-batch-size", "4"]]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark; returns the rows."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one tiny model, one round")
    p.add_argument("--devices", type=int, default=2, help="devices of the one process (data parallel)")
    p.add_argument("--gpu", action="store_true", help="run on JAX's default backend (a GPU host: its first "
                   "--devices devices), not on --devices simulated CPU devices")
    p.add_argument("--steps", type=int, default=5, help="steps timed after each async save")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--trace-dir", default=None, help="trace one more async save of the first model and its "
                   "steps there (jax.profiler; python -m core.training.profile_summary DIR --raw)")
    p.add_argument("--model-flags", default=None, help="measure this one model instead (launch/pretrain.py flags, "
                   "e.g. bench/gpu.py's GPT)")
    p.add_argument("--one-copy", action="store_true", help="the device holds one training state only (a large "
                   "model on one GPU): load into the training model, time the writer process only, keep one "
                   "checkpoint per directory")
    p.add_argument("--free-cores", action="store_true", help="CPU: size XLA's thread pool to one core, so the "
                   "steps leave the other cores free for the writer, as on a GPU host (Linux)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint.md"))
    a = p.parse_args(argv)
    if not a.gpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(a.devices))
    if a.free_cores:
        _one_core_pool()
    models, reps, steps = (QUICK_MODELS, 1, 2) if a.quick else (MODELS, a.reps, a.steps)
    if a.model_flags is not None:
        models = [a.model_flags.split()]
    rows = []
    for i, flags in enumerate(models):
        with tempfile.TemporaryDirectory() as workdir:
            rows.append(measure(flags, a.devices, steps, reps, workdir, a.trace_dir if i == 0 else None, a.one_copy))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = (f"{table(rows)}\n\nMemory per device:\n\n{memory_table(rows)}\n\n"
            f"The writer process's saves in the training process (median):\n\n{phases_table(rows)}")
    print(text)
    if not a.quick and a.model_flags is None and not a.free_cores:
        write_text_atomically(a.out, f"# bench/checkpoint.py ({time.strftime('%Y-%m-%d')})\n\n{text}\n")
    return rows


if __name__ == "__main__":
    main()
