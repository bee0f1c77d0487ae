"""Megatron-LM's training loop, written as a Megatron user writes it, on this package.

    python examples/megatron_style_loop.py                          # one process, 8 CPU devices
    mpirun --oversubscribe -n 8 python examples/megatron_style_loop.py

A two-layer MLP built from ``ColumnParallelLinear``/``RowParallelLinear`` (tp=2), wrapped in
``DistributedDataParallel(config, ddp_config, module)`` (dp=4, distributed optimizer), trained
with Megatron's loop: ``model.zero_grad_buffer()``, ``get_forward_backward_func()`` with a
``forward_step_func`` and a per-token ``loss_func``, ``finalize_model_grads([model],
num_tokens)``, ``optimizer.step()`` of the optimizer built by ``get_megatron_optimizer(config,
[model])``. The script then trains the same MLP on one device with
plain JAX and optax and checks that losses and parameters agree (fp32, rtol 1e-5).

Differences from Megatron that the JAX form imposes: ``forward_step_func`` receives the
microbatch (taken from the iterator by the schedule) rather than the iterator; parameters are
values the DDP facade keeps as ``model.params`` (the optimizer's step replaces them); ``num_tokens``
is the global token count.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

IN, FFN, OUT = 8, 32, 4
GLOBAL_BATCH, NUM_MICROBATCHES, SEQ = 16, 2, 3
RTOL = 1e-5


class ToyModel(nn.Module):
    """``fc2(tanh(fc1(x)))`` with Megatron's tensor-parallel linears (fc1 split by output
    features, fc2 by input features: one all-reduce per forward)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the MLP to ``[batch, seq, IN]`` inputs."""
        from core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        h, _ = ColumnParallelLinear(IN, FFN, name="fc1")(x)
        y, _ = RowParallelLinear(FFN, OUT, input_is_parallel=True, name="fc2")(jnp.tanh(h))
        return y


def make_data(step: int) -> dict[str, np.ndarray]:
    """Global batch of a step: inputs, targets and a loss mask with a varying token count."""
    rng = np.random.default_rng(step)
    mask = (rng.random((GLOBAL_BATCH, SEQ)) < 0.7).astype(np.float32)
    mask[:, 0] = 1.0
    return {"x": rng.normal(size=(GLOBAL_BATCH, SEQ, IN)).astype(np.float32),
            "y": rng.normal(size=(GLOBAL_BATCH, SEQ, OUT)).astype(np.float32), "mask": mask}


def loss_func(labels: jax.Array, loss_mask: jax.Array, output: jax.Array):
    """Megatron's per-token form: ``(loss summed over tokens, num_tokens, reporting dict)``."""
    per_token = jnp.sum((output - labels) ** 2, axis=-1) * loss_mask
    num_tokens = jnp.sum(loss_mask)
    return jnp.sum(per_token), num_tokens, {"lm loss": jnp.stack([jnp.sum(per_token), num_tokens])}


def forward_step_func(data: dict, model):
    """Megatron's forward step: run the model, hand back the loss function of its output."""
    output = model(data["x"])
    return output, functools.partial(loss_func, data["y"], data["mask"])


def train(tp: int = 2, steps: int = 4, use_distributed_optimizer: bool = True):
    """Megatron's loop; returns (losses per step, final parameters as host numpy arrays)."""
    from jax.sharding import NamedSharding

    from core import parallel_state as ps
    from core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from core.optimizer import OptimizerConfig, get_megatron_optimizer
    from core.pipeline_parallel import get_forward_backward_func

    config = ps.build_parallel_state(tensor_model_parallel_size=tp)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                               grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config, ddp_config, ToyModel())
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0), [model])
    model.init(jax.random.key(0), jnp.zeros((2, SEQ, IN)))
    forward_backward_func = get_forward_backward_func(config)
    batch_sharding = NamedSharding(config.mesh, model.batch_spec)
    micro = GLOBAL_BATCH // NUM_MICROBATCHES

    def microbatches(data):
        """Global arrays of each microbatch, rows split over data parallelism (every process
        builds the arrays from the same global numpy batch)."""
        for m in range(NUM_MICROBATCHES):
            rows = {k: v[m * micro:(m + 1) * micro] for k, v in data.items()}
            yield {k: jax.make_array_from_callback(v.shape, batch_sharding, lambda idx, v=v: v[idx])
                   for k, v in rows.items()}

    losses = []
    for step in range(steps):
        data = make_data(step)
        model.zero_grad_buffer()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=microbatches(data), model=[model],
            num_microbatches=NUM_MICROBATCHES, seq_length=SEQ, micro_batch_size=micro, forward_only=False)
        num_tokens = float(data["mask"].sum())
        finalize_model_grads([model], num_tokens)
        update_successful, grad_norm, _ = optimizer.step()
        # The dicts are averaged over the dp ranks: dp x (loss sum, tokens) is the global sum.
        totals = sum(np.asarray(d["lm loss"]) for d in losses_reduced)
        losses.append(float(totals[0] / totals[1]))
        if jax.process_index() == 0:
            print(f"step {step}: loss {losses[-1]:.6f}  grad norm {float(grad_norm):.4f}", flush=True)
    return losses, model.state_dict()


def reference(init_params: dict[str, np.ndarray], steps: int = 4):
    """The same training on one device: plain JAX, optax AdamW with Megatron's decay mask and
    global-norm clipping."""
    import optax

    from core.optimizer.clip_grads import clip_coefficient

    dev = jax.local_devices()[0]
    params = {k: jax.device_put(v, dev) for k, v in init_params.items()}

    def apply(p, x):
        h = jnp.tanh(x @ p["params/fc1/weight"].T + p["params/fc1/bias"])
        return h @ p["params/fc2/weight"].T + p["params/fc2/bias"]

    def loss(p, d):
        per_token = jnp.sum((apply(p, d["x"]) - d["y"]) ** 2, axis=-1) * d["mask"]
        return jnp.sum(per_token) / jnp.sum(d["mask"])

    tx = optax.adamw(1e-2, 0.9, 0.999, 1e-8, weight_decay=0.1, mask={k: v.ndim > 1 for k, v in params.items()})

    @jax.jit
    def step(p, opt, d):
        value, g = jax.value_and_grad(loss)(p, d)
        coef = clip_coefficient(optax.tree.norm(g), 1.0)
        updates, opt = tx.update(jax.tree.map(lambda x: x * coef, g), opt, p)
        return optax.apply_updates(p, updates), opt, value

    opt, losses = tx.init(params), []
    for s in range(steps):
        params, opt, value = step(params, opt, jax.device_put(make_data(s), dev))
        losses.append(float(value))
    return losses, {k: np.asarray(v) for k, v in params.items()}


def initial_params(tp: int = 2) -> dict[str, np.ndarray]:
    """The initial parameters of :func:`train` (zero steps)."""
    return train(tp, steps=0)[1]


def check(tp: int = 2, steps: int = 4) -> float:
    """Train both ways; raise if they differ; return the largest absolute parameter difference."""
    losses, params = train(tp, steps)
    ref_losses, ref_params = reference(initial_params(tp), steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    worst = 0.0
    for k, v in ref_params.items():
        np.testing.assert_allclose(params[k], v, rtol=RTOL, atol=1e-6, err_msg=k)
        worst = max(worst, float(np.max(np.abs(params[k] - v))))
    return worst


def main() -> None:
    """Set up JAX for one process (8 CPU devices) or mpirun (one per process) and check."""
    from core.parallel_state import initialize_distributed, mpi_world_size_from_env

    if mpi_world_size_from_env() > 1:
        initialize_distributed()
    else:
        jax.config.update("jax_num_cpu_devices", 8)
    worst = check()
    if jax.process_index() == 0:
        print(f"matches single device (losses and params within rtol {RTOL}; largest param difference {worst:.1e})")


if __name__ == "__main__":
    main()
