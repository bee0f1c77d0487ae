"""The DDP path's overhead at dp = 1: this package's training step against a plain jitted step of
the same GPT on one device.

    python bench/ddp_overhead.py                  # a small GPT on one CPU device
    python bench/ddp_overhead.py --gpt-1b --bf16  # bench/gpu.py's ~1.2B GPT (one GPU)

* ``package``: ``Pretrainer``'s step (``DistributedDataParallel.make_train_step``: grad buffers,
  ``finalize_model_grads``, global-norm clipping, AdamW with decay on matrices), one microbatch;
* ``plain``: ``jax.jit`` of ``value_and_grad`` of the model's mean loss then optax global-norm clipping
  and AdamW: ``bench/e2e_jax.py``'s tutorial recipe without its gradient ``pmean`` (its
  ``shard_map`` over the same one-device mesh only binds the model's axis names), params and
  optimizer state donated as in the package.

The same model, parameters and batch; each variant's step is the median over ``--steps`` of
``--steps`` back-to-back steps per round (dispatch then wait), rounds alternating between the
variants. Prints one JSON line (``package_ms``, ``plain_ms``, ``ratio``). Target: ratio <= 1.03.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GPT_1B = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
          "--micro-batch-size", "4", "--global-batch-size", "4"]
"""bench/gpu.py's GPT with one microbatch of 4."""
SMALL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "4", "--global-batch-size", "4"]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpt-1b", action="store_true", help="bench/gpu.py's ~1.2B GPT (default: a small GPT)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--steps", type=int, default=5, help="steps per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds per variant, alternating")
    return p.parse_args(argv)


def _trainer(a: argparse.Namespace):
    import jax

    from core import parallel_state as ps
    from core.training.arguments import parse_args, validate_args
    from core.training.pretrainer import Pretrainer
    from core.training.run_config import pretrain_config

    flags = [*(GPT_1B if a.gpt_1b else SMALL), "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
             "1", "--train-iters", "1000", "--eval-interval", "1000000", "--lr", "3e-4", "--no-progress-bar"]
    args = parse_args(flags + (["--bf16"] if a.bf16 else []))
    layout = validate_args(args, 1)
    return Pretrainer(pretrain_config(args), layout, ps.build_parallel_state(1, 1, devices=jax.devices()[:1]))


def main(argv: list[str] | None = None) -> dict:
    """Measure both steps; print and return the JSON record."""
    a = _args(argv)
    import jax
    from e2e_jax import pmean_recipe_step
    from jax.sharding import PartitionSpec as P

    from core.training.train_step import mean_loss

    trainer = _trainer(a)
    batch = trainer.data.next_train_batch()
    params = jax.tree.map(lambda x: x.copy(), trainer.params)  # the plain step's own copy (both donate)
    plain, plain_opt = pmean_recipe_step(mean_loss(trainer.model.loss_fn), params, jax.tree.map(lambda _: P(), params),
                                         trainer.state.mesh, trainer.state.data_parallel_axis_name,
                                         reduce_grads=False)
    state = {"package": [trainer.params, trainer.opt_state], "plain": [params, plain_opt]}
    steps = {"package": lambda p, o: trainer.train_step(p, o, batch)[:2],
             "plain": lambda p, o: plain(p, o, batch)[:2]}
    times: dict[str, list[float]] = {"package": [], "plain": []}
    for round_ in range(a.rounds + 1):  # round 0 warms up: compile, and the second call's
        for name, run in steps.items():  # retrace for the outputs' shardings
            start = time.perf_counter()
            for _ in range(a.steps if round_ else max(2, a.steps)):
                state[name] = list(run(*state[name]))
            jax.block_until_ready(state[name])
            if round_:
                times[name].append((time.perf_counter() - start) / a.steps)
    package, plain_ms = (1e3 * statistics.median(times[k]) for k in ("package", "plain"))
    device = jax.devices()[0]
    record = {"model": trainer.config.describe(), "bf16": a.bf16, "device": f"{device.platform}:{device.device_kind}",
              "package_ms": package, "plain_ms": plain_ms, "ratio": package / plain_ms}
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
