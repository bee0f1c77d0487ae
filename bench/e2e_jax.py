"""The JAX workers of ``bench/e2e.py`` (run under ``mpirun``; rank 0 prints one JSON line).

* ``--impl package``: this package's GPT training step (``core.training.Pretrainer``: DDP
  buckets, ``finalize_model_grads``, pipeline schedule, optimizer) for a (tp, pp) layout, dp
  the rest of the world;
* ``--impl pmean``: the classic tutorial recipe on the same model, one process per device: a
  ``shard_map`` step that ``lax.pmean``-s every gradient leaf over the data axis, then
  global-norm clipping and optax AdamW (``--no-grad-reduction`` drops the ``pmean``: what the
  step costs without communication; the replicas then drift apart, so it is a timing probe).

Both train the same GPT (``--layers/--hidden/--heads/--seq``, vocabulary 256) with the same
global batch on the same data; the step time is the median of ``--steps`` after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.runtime.cpu_threads import configure_cpu_threads, release_cpu_affinity  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["package", "pmean"], required=True)
    for name, default in [("tp", 1), ("pp", 1), ("layers", 4), ("hidden", 256), ("heads", 4), ("seq", 256),
                          ("global-batch", 32), ("microbatches", 1), ("steps", 10), ("warmup", 3)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--peak", action="store_true", help="also measure the matmul peak and MFU")
    p.add_argument("--no-grad-reduction", action="store_true",
                   help="pmean only: skip the gradient pmean (the step's cost without communication)")
    a = p.parse_args()
    if a.no_grad_reduction and a.impl != "pmean":
        p.error("--no-grad-reduction applies to --impl pmean only")
    return a


def _pretrain_flags(a: argparse.Namespace, world: int) -> list[str]:
    dp = world // (a.tp * a.pp)
    micro = a.global_batch // (dp * a.microbatches)
    flags = ["--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
             "--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
             "--seq-length", str(a.seq), "--micro-batch-size", str(micro), "--global-batch-size",
             str(a.global_batch), "--train-iters", str(a.warmup + a.steps), "--lr", "3e-4", "--no-progress-bar",
             "--eval-interval", "1000000"]
    return flags + (["--use-distributed-optimizer"] if a.distributed_optimizer else [])


def package_step_times(a: argparse.Namespace, world: int):
    """Step times of this package's training loop, and its model."""
    from core import parallel_state as ps
    from core.training.arguments import parse_args, validate_args
    from core.training.pretrainer import Pretrainer
    from core.training.run_config import pretrain_config

    args = parse_args(_pretrain_flags(a, world))
    layout = validate_args(args, world)
    trainer = Pretrainer(pretrain_config(args), layout, ps.initialize_model_parallel(a.tp, a.pp))
    times = [trainer.step()["step_time_s"] for _ in range(a.warmup + a.steps)]
    return times[a.warmup:], trainer.config


def pmean_recipe_step(loss_fn, params, specs, mesh, axes, reduce_grads: bool = True):
    """The tutorial recipe's jitted ``step(params, opt_state, batch) -> (params, opt_state,
    {"loss"})`` and its initial optimizer state: ``lax.pmean`` of every gradient leaf over
    ``axes`` (unless ``reduce_grads`` is off), global-norm clipping and optax AdamW in a
    ``shard_map``, params and state donated."""
    import jax
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    opt_state = jax.jit(tx.init)(params)

    def step(p, o, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        if reduce_grads:
            grads = jax.tree.map(lambda g: lax.pmean(g, axes), grads)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, {"loss": lax.pmean(loss, axes)}

    opt_specs = jax.tree.map(lambda _: P(), opt_state)
    jitted = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, opt_specs, P(axes)),
                                   out_specs=(specs, opt_specs, P()), check_vma=False), donate_argnums=(0, 1))
    return jitted, opt_state


def pmean_step_times(a: argparse.Namespace, world: int):
    """Step times of the tutorial per-leaf ``pmean`` recipe on the same model and data."""
    import jax
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps
    from core.models.gpt import GPTModel
    from core.param_metadata import init_sharded_params
    from core.training.arguments import model_config, parse_args, validate_args
    from core.training.pretraining_data import PretrainingData
    from core.training.run_config import data_config, training_config
    from core.training.train_step import mean_loss

    args = parse_args(_pretrain_flags(a, world))
    validate_args(args, world)
    state = ps.initialize_model_parallel(1, 1)
    data = PretrainingData(data_config(args), training_config(args), state)  # the package's batches
    model = GPTModel(model_config(args), state)
    mesh, axes = state.mesh, state.data_parallel_axis_name
    sample = jax.numpy.zeros((args.global_batch_size // world, args.seq_length), jax.numpy.int32)
    params, specs, _ = init_sharded_params(model.init, mesh, (jax.random.key(args.seed), sample), (P(), P()))
    jitted, opt_state = pmean_recipe_step(mean_loss(model.loss_fn), params, specs, mesh, axes,
                                          reduce_grads=not a.no_grad_reduction)
    times = []
    for _ in range(a.warmup + a.steps):
        batch = data.next_train_batch()
        t = time.perf_counter()
        params, opt_state, metrics = jitted(params, opt_state, batch)
        float(metrics["loss"])
        times.append(time.perf_counter() - t)
    return times[a.warmup:], model.config


def main() -> None:
    """Measure and print rank 0's JSON line."""
    a = _args()
    from core.parallel_state import initialize_distributed, mpi_world_size_from_env
    from core.runtime.cpu_devices import configure_cpu_devices, cpu_devices_per_process
    from core.training.arguments import layout_fits, parse_args

    processes = mpi_world_size_from_env()
    # as the package's launch path: on CPU, one device per core of this process's share, and a
    # thread pool of the share's size unless pipelined
    configure_cpu_devices(cpu_devices_per_process(
        lambda n: layout_fits(parse_args(_pretrain_flags(a, processes * n)), processes * n)))
    threads = configure_cpu_threads(share_pool=a.pp == 1)
    import jax

    if processes > 1:
        initialize_distributed()
    world = jax.device_count()
    release_cpu_affinity()  # the backend has sized its thread pool
    times, config = (package_step_times if a.impl == "package" else pmean_step_times)(a, world)
    step_time = statistics.median(times)
    tokens = a.global_batch * a.seq
    record = {"impl": a.impl, "world": jax.process_count(), "devices": world, "tp": a.tp, "pp": a.pp,
              "dp": world // (a.tp * a.pp), "step_time_s": step_time, "tokens_per_sec": tokens / step_time,
              "threads": threads, "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
              "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "device": f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}"}
    if a.peak:
        from core.training.device_peak import measure_matmul_peak

        peak = measure_matmul_peak()
        record["matmul_peak_flops"] = peak
        # per process: the peak is this process's (its devices share its cores)
        record["model_flops_per_sec"] = config.flops_per_token() * tokens / step_time / jax.process_count()
        record["mfu"] = record["model_flops_per_sec"] / peak
    from jax.experimental import multihost_utils

    mem = multihost_utils.process_allgather(jax.numpy.asarray(record["peak_memory_bytes"], jax.numpy.float32))
    record["peak_memory_bytes"] = int(max(mem.reshape(-1)))
    if jax.process_index() == 0:
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    from core.runtime.cpu_malloc import reexec_with_malloc_settings

    reexec_with_malloc_settings()  # as the package's launch path does
    main()
