"""Device memory of the training step per device, by data-parallel size: what the distributed
optimizer saves, and that nothing else is held beside the state.

    python bench/optimizer_memory.py            # ~6 min on 2 cores
    python bench/optimizer_memory.py --quick    # one tiny model, seconds

For each model (``launch/pretrain.py`` flags) and data-parallel size, one process with that many
simulated CPU devices builds the ``Pretrainer`` step (tp=pp=1, distributed optimizer on and off)
and reads XLA's ``memory_analysis`` of the compiled program (deterministic, nothing run):

* **params**, **optimizer state**: what one device holds of each (the state: fp32 masters
  where the params are not fp32, Adam's moments, step counts);
* **step's inputs**: the compiled step's argument bytes per device: params, optimizer state and
  the micro-batches, and any constant the step takes;
* **extra**: inputs minus params, optimizer state and batch: 0 when the step holds nothing
  beside the state (per-element masks of whole buckets, for instance, 3 bytes per parameter on
  every device, would show here);
* **temporaries**: the step's scratch memory (activations, gradients, collectives' buffers).

Prints a table and writes ``bench/results/optimizer_memory.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from core.atomic_files import write_text_atomically  # noqa: E402

MIB = 1024 * 1024
MODELS = [["--hidden-size", "512", "--num-attention-heads", "8"],
          ["--hidden-size", "1024", "--num-attention-heads", "8", "--num-layers", "8"]]
QUICK_MODELS = [["--num-layers", "1", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "1"]]


def measure(model_flags: list[str], dp: int, distributed: bool) -> dict[str, Any]:
    """One row: per-device MiB of the step (see the module docstring) with ``dp`` devices."""
    import jax

    from core import parallel_state as ps
    from core.training.arguments import parse_args, validate_args
    from core.training.pretrainer import Pretrainer
    from core.training.run_config import pretrain_config

    args = parse_args([*model_flags, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                       "--global-batch-size", str(8 * dp), "--train-iters", "10", "--no-progress-bar",
                       *(["--use-distributed-optimizer"] if distributed else [])])
    layout = validate_args(args, dp)
    state = ps.build_parallel_state(1, 1, devices=jax.devices()[:dp])
    trainer = Pretrainer(pretrain_config(args), layout, state)
    batch = trainer.data.next_train_batch()
    device = trainer.ddp.mesh.devices.flat[0]
    on_device = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
                                 if s.device == device)
    params, opt, data = on_device(trainer.params), on_device(trainer.opt_state), on_device(batch)
    memory = trainer.train_step.lower(trainer.params, trainer.opt_state, batch).compile().memory_analysis()
    return {"model": trainer.config.describe(), "dp": dp, "distributed": distributed, "params_mib": params / MIB,
            "opt_mib": opt / MIB, "inputs_mib": memory.argument_size_in_bytes / MIB,
            "extra_mib": (memory.argument_size_in_bytes - params - opt - data) / MIB,
            "temp_mib": memory.temp_size_in_bytes / MIB}


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`measure`'s rows."""
    lines = ["| model | dp | optimizer | params | optimizer state | step's inputs | extra | temporaries |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dp']} | {'distributed' if r['distributed'] else 'replicated'} "
                     f"| {r['params_mib']:.1f} MiB | {r['opt_mib']:.1f} MiB | {r['inputs_mib']:.1f} MiB "
                     f"| {r['extra_mib']:.2f} MiB | {r['temp_mib']:.1f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark; returns the rows."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one tiny model")
    p.add_argument("--dp", default="2,8", help="data-parallel sizes (simulated CPU devices)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "optimizer_memory.md"))
    a = p.parse_args(argv)
    sizes = [int(d) for d in a.dp.split(",")]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(max(sizes)))
    rows = []
    for flags in QUICK_MODELS if a.quick else MODELS:
        for dp in sizes:
            for distributed in (False, True):
                rows.append(measure(flags, dp, distributed))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = table(rows)
    print(text)
    if not a.quick:
        write_text_atomically(a.out, f"# bench/optimizer_memory.py ({time.strftime('%Y-%m-%d')})\n\n{text}\n")
    return rows


if __name__ == "__main__":
    main()
