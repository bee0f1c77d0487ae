"""The DDP step's part after the backward, side by side with the per-leaf ``pmean`` recipe's.

    python bench/optimizer_step.py                 # one process, 2 CPU devices (dp=2)
    python bench/optimizer_step.py --devices 1 --rounds 30

Everything a data-parallel training step does after the backward: the gradient reduction,
the global norm and clipping, AdamW, the parameter update. The parameters are the end-to-end
benchmark GPT's (4 layers, hidden 256: 3.3M in 16 arrays) and the loss is linear in them, so
the forward and backward cost next to nothing and the step time is this part. The variants,
built in one process and called in turn (round-robin, so the host's slow spells hit them alike),
median per variant:

* ``package``: ``DistributedDataParallel.make_train_step`` as ``launch/pretrain.py`` builds it
  (replicated optimizer, per-leaf state, no in-step NaN skip);
* ``package, NaN skip``: the same with ``check_for_nan_in_grad`` (the update in a ``lax.cond``);
* ``package, dist-opt``: ``use_distributed_optimizer`` (reduce-scatter, sharded Adam, gather);
* ``pmean recipe``: ``lax.pmean`` of every gradient leaf, ``optax.clip_by_global_norm`` and
  ``optax.adamw`` in a ``shard_map`` (the tutorial recipe of ``bench/e2e_jax.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=2, help="CPU devices in the process (dp)")
    p.add_argument("--rounds", type=int, default=40, help="timed calls per variant")
    return p.parse_args()


def _variants(devices: int) -> dict:
    """name -> (step, params, opt_state, batch) for every variant."""
    import jax
    import jax.numpy as jnp
    from e2e_jax import pmean_recipe_step
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps
    from core.distributed.distributed_data_parallel import DistributedDataParallel
    from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from core.models.gpt import GPTModel
    from core.optimizer import get_megatron_optimizer
    from core.optimizer.optimizer_config import OptimizerConfig
    from core.param_metadata import init_sharded_params
    from core.training.arguments import model_config, parse_args
    from core.training.train_step import make_train_step

    args = parse_args(["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
                       "--seq-length", "256"])
    state = ps.initialize_model_parallel(1, 1)
    model = GPTModel(model_config(args), state)
    sample = jnp.zeros((2, args.seq_length), jnp.int32)
    axes = state.data_parallel_axis_name
    batch = {"x": jax.device_put(jnp.ones((devices, 8)), NamedSharding(state.mesh, P(axes)))}

    def loss_fn(params, mb):  # linear in the params: a gradient of ones times a batch mean
        return jnp.mean(mb["x"]) * sum(jnp.sum(leaf) for leaf in jax.tree.leaves(params))

    out = {}
    adam = OptimizerConfig(optimizer="adam", lr=3e-4, weight_decay=0.1, adam_beta2=0.95, clip_grad=1.0)
    for name, cfg in [("package", {}), ("package, NaN skip", {"check_for_nan_in_grad": True}),
                      ("package, dist-opt", {"use_distributed_optimizer": True})]:
        ddp = DistributedDataParallel(state, DistributedDataParallelConfig(grad_reduce_in_fp32=True, **cfg), model)
        opt = get_megatron_optimizer(adam, [ddp])
        params = ddp.init(jax.random.key(0), sample)
        out[name] = (make_train_step(ddp, opt, loss_fn), params, opt.init_state(params), batch)

    params, specs, _ = init_sharded_params(model.init, state.mesh, (jax.random.key(0), sample), (P(), P()))
    step, opt_state = pmean_recipe_step(loss_fn, params, specs, state.mesh, axes)
    out["pmean recipe"] = (step, params, opt_state, batch)
    return out


def main() -> None:
    """Time the variants round-robin and print the table."""
    a = _args()
    from core.runtime.cpu_devices import configure_cpu_devices

    configure_cpu_devices(a.devices)
    import jax

    variants = _variants(a.devices)
    state = {name: [params, opt] for name, (_, params, opt, _) in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(a.rounds + 3):
        for name, (step, _, _, batch) in variants.items():
            start = time.perf_counter()
            params, opt, metrics = step(*state[name], batch)
            float(metrics["loss"])
            if i >= 3:  # compile and warm-up
                times[name].append(time.perf_counter() - start)
            state[name] = [params, opt]
    base = statistics.median(times["pmean recipe"])
    print(f"after-backward part of a DP step, GPT 3.3M params, {a.devices} {jax.devices()[0].platform} device(s), "
          f"median of {a.rounds}\n")
    print("| variant | ms | vs pmean recipe |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {1e3 * statistics.median(ts):.1f} | {statistics.median(ts) / base:.2f}x |")


if __name__ == "__main__":
    from core.runtime.cpu_malloc import reexec_with_malloc_settings

    reexec_with_malloc_settings()  # as the package's launch path does
    main()
