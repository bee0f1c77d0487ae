"""What an async save's snapshot costs the step loop, by snapshot design (a GPU question).

    PYTHONPATH=. python bench/snapshot_dispatch.py            # on a GPU host, ~1 min
    python bench/snapshot_dispatch.py --smoke                 # tiny model, checks the script (CPU)

An async save's blocking part is the dispatch of the program that copies the training state
(``Checkpointer.checkpoint_state``). On a GPU that dispatch alone is a large share of the
default model's short step, more than a stall target of 10% of a step allows
(``bench/results/2026-11-gpu.md``). This measures, side by side in one process on the default
backend's first device, the default model (``launch/pretrain.py``'s, distributed optimizer),
what other designs would cost, before any of them is built:

* **dispatch** (median ms, the caller's time until the program is enqueued): the training step;
  the snapshot as it is (one output per leaf: params, the optimizer state's global form);
  ``packed``: the same values packed into one block per dtype per device (a few outputs instead
  of ~50, the design "one flattened snapshot per device"); ``pinned``: the snapshot as it is
  with its outputs in pinned host memory (no device-to-host copies left for the save thread;
  GPU only). On the CPU backend XLA runs a cheap program inline, so there dispatch includes the
  run: read the CPU figures as a check of the script only;
* **run** (median ms, dispatch to ready): what each program costs the device's stream;
* **to host** (median ms, wall and the calling thread's CPU time): what the save thread then
  does before the shared buffer: the batched ``device_put`` into pinned host memory (as
  ``core.checkpointing.writer_process`` stages it) and ``np.asarray`` of every result, per leaf against
  per block;
* **memory**: each program's outputs and temporaries (XLA's ``memory_analysis``).

Prints a markdown table; ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from core.atomic_files import write_text_atomically  # noqa: E402

MIB = 1024 * 1024
SMOKE_MODEL = ["--num-layers", "1", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
               "--global-batch-size", "2"]


def pack_by_dtype(tree: Any, specs: Any, mesh: Any) -> dict[str, Any]:
    """``tree``'s arrays (shardings ``specs`` on ``mesh``) as one block per dtype: a global
    ``[devices, n]`` array whose row on each device is that device's local shards, flattened and
    concatenated (traceable; the same bytes as the per-leaf snapshot, fewer outputs)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def local(leaves: list) -> dict[str, Any]:
        groups: dict[str, list] = {}
        for x in leaves:
            groups.setdefault(str(x.dtype), []).append(x.reshape(-1))
        return {dtype: jnp.concatenate(parts)[None] for dtype, parts in sorted(groups.items())}

    leaves, spec_leaves = jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    dtypes = sorted({str(x.dtype) for x in leaves})
    out = {dtype: P(tuple(mesh.axis_names)) for dtype in dtypes}
    return jax.shard_map(local, mesh=mesh, in_specs=(spec_leaves,), out_specs=out, check_vma=False)(leaves)


def programs(trainer: Any) -> dict[str, Callable]:
    """The snapshot programs compared, each ``f(params, opt_state, model_state)``."""
    import jax

    ddp, opt = trainer.ddp, trainer.optimizer
    split = jax.tree.map(ddp.checkpoint_sharding, trainer.params)
    abstract = opt.global_state_abstract()

    def gather(params: Any, opt_state: Any, model_state: Any) -> dict[str, Any]:
        state = {"params": jax.tree.map(jax.lax.with_sharding_constraint, params, split),
                 "opt_state": opt.state_to_global(opt_state)}
        return state if model_state is None else {**state, "model_state": model_state}

    specs = {"params": jax.tree.map(lambda s: s.spec, split),
             "opt_state": jax.tree.map(lambda x: x.sharding.spec, abstract)}
    if trainer.model_state is not None:
        specs["model_state"] = jax.tree.map(lambda x: x.sharding.spec, trainer.model_state)
    out = {"per leaf": trainer.checkpointer._make_checkpoint_copy(trainer.training_state()),
           "packed by dtype": jax.jit(lambda *a: pack_by_dtype(gather(*a), specs, ddp.mesh))}
    device = ddp.mesh.devices.flat[0]
    if any(m.kind == "pinned_host" for m in device.addressable_memories()):
        shardings = {"params": split, "opt_state": jax.tree.map(lambda x: x.sharding, abstract)}
        if trainer.model_state is not None:
            shardings["model_state"] = jax.tree.map(lambda x: x.sharding, trainer.model_state)
        pinned = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings)
        out["per leaf, outputs in pinned host memory"] = jax.jit(
            lambda *a: jax.tree.map(lambda x: x.copy(), gather(*a)), out_shardings=pinned)
    return out


def _to_host(outputs: Any) -> tuple[float, float]:
    """``(wall, thread CPU)`` seconds of the save thread's staging of ``outputs``' shards as the
    writer process stages them (``core.checkpointing.writer_process._to_host``: one batched ``device_put``
    into pinned host memory where the device has it), then ``np.asarray`` of each; outputs already
    in pinned host memory are only read."""
    import jax
    import numpy as np

    from core.checkpointing.writer_process import _to_host as stage

    leaves = jax.tree.leaves(outputs)
    wall, cpu = time.perf_counter(), time.thread_time()
    shards = [shard.data for x in leaves for shard in x.addressable_shards]
    if any(x.sharding.memory_kind != "pinned_host" for x in leaves):
        shards = stage(shards, pinned_host=True)
    for x in shards:
        np.asarray(x)
    return time.perf_counter() - wall, time.thread_time() - cpu


def measure(model_flags: list[str], reps: int) -> list[dict[str, Any]]:
    """One row per program (see the module docstring); the step first."""
    import jax
    from checkpoint import _steps, _trainer

    trainer = _trainer(model_flags, 1, [])
    _steps(trainer, 2)
    args = lambda: (trainer.params, trainer.opt_state, trainer.model_state)
    progs = programs(trainer)
    for f in progs.values():
        jax.block_until_ready(f(*args()))
    times: dict[str, dict[str, list[float]]] = {name: {"dispatch": [], "run": [], "wall": [], "cpu": []}
                                                for name in ["step", *progs]}
    for _ in range(reps):  # alternated, so drift between rounds hits every program alike
        start = time.perf_counter()
        pending = trainer.dispatch_step()
        times["step"]["dispatch"].append(time.perf_counter() - start)
        jax.block_until_ready(pending["loss"])
        times["step"]["run"].append(time.perf_counter() - start)
        for name, f in progs.items():
            start = time.perf_counter()
            outputs = f(*args())
            times[name]["dispatch"].append(time.perf_counter() - start)
            jax.block_until_ready(outputs)
            times[name]["run"].append(time.perf_counter() - start)
            wall, cpu = _to_host(outputs)
            times[name]["wall"].append(wall)
            times[name]["cpu"].append(cpu)
            del outputs
    ms = lambda xs: statistics.median(xs) * 1e3 if xs else None
    rows = []
    for name, t in times.items():
        row = {"program": name, **{k: ms(v) for k, v in t.items()}, "outputs": None, "out_mib": None,
               "temp_mib": None}
        if name in progs:
            memory = progs[name].lower(*args()).compile().memory_analysis()
            row.update(outputs=len(jax.tree.leaves(progs[name](*args()))),
                       out_mib=memory.output_size_in_bytes / MIB, temp_mib=memory.temp_size_in_bytes / MIB)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], backend: str) -> str:
    """The markdown table of :func:`measure`'s rows."""
    num = lambda x, f="{:.3f}": "-" if x is None else f.format(x)
    lines = [f"Snapshot designs on `{backend}` (median ms; dispatch on the CPU includes the run):", "",
             "| program | outputs | dispatch | run | to host: wall | to host: thread CPU | outputs MiB "
             "| temporaries MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['program']} | {num(r['outputs'], '{}')} | {num(r['dispatch'])} | {num(r['run'])} "
                     f"| {num(r['wall'] if r['outputs'] else None)} | {num(r['cpu'] if r['outputs'] else None)} "
                     f"| {num(r['out_mib'], '{:.1f}')} | {num(r['temp_mib'], '{:.1f}')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark; returns the rows."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model, few rounds (checks the script)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--model-flags", default=None, help="launch/pretrain.py flags of another model")
    p.add_argument("--out", default=None, help="also write the table here")
    a = p.parse_args(argv)
    import jax

    flags = SMOKE_MODEL if a.smoke else (a.model_flags.split() if a.model_flags else [])
    rows = measure(flags, 3 if a.smoke else a.reps)
    text = table(rows, f"{jax.devices()[0].device_kind}, JAX {jax.__version__}")
    print(text)
    if a.out:
        write_text_atomically(a.out, f"# bench/snapshot_dispatch.py ({time.strftime('%Y-%m-%d')})\n\n{text}\n")
    return rows


if __name__ == "__main__":
    main()
