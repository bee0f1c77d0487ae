"""DDP + tensor parallelism (+ sequence parallelism) + distributed optimizer + global clipping
equals single-device training of the dense model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tp_harness import dense_parallel_mlp

from core import parallel_state as ps
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.optimizer import get_megatron_optimizer
from core.optimizer.clip_grads import clip_coefficient
from core.optimizer.optimizer_config import OptimizerConfig
from core.training.train_step import make_train_step
from core.transformer.mlp import ParallelMLP

S, B, H, F = 8, 8, 16, 32


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_tp2_dp4_training_equals_dense(sequence_parallel, use_distributed_optimizer):
    state = ps.build_parallel_state(2)
    module = ParallelMLP(H, F, sequence_parallel=sequence_parallel)
    cfg = OptimizerConfig(optimizer="adam", lr=0.01, weight_decay=0.1, clip_grad=0.01)
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                                                       grad_reduce_in_fp32=True), module)
    opt = get_megatron_optimizer(cfg, [ddp])
    rng = np.random.default_rng(0)
    # Batches are [b, s, h] (split over dp on dim 0); the block wants [s, b, h] (SP splits s over tp).
    xs = [rng.normal(size=(B, S, H)).astype(np.float32) for _ in range(3)]
    sample = jnp.zeros((S // 2 if sequence_parallel else S, 1, H))
    params = ddp.init(jax.random.key(0), sample)
    ref = jax.tree.map(np.asarray, params)
    opt_state = opt.init_state(params)

    def loss_fn(p, batch):
        x = jnp.swapaxes(batch, 0, 1)
        if sequence_parallel:  # this tp rank's sequence shard
            n = x.shape[0] // jax.lax.axis_size("tp")
            x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("tp") * n, n, 0)
        y = module.apply(p, x)
        local = jnp.mean(jnp.tanh(y) ** 2)
        # Under SP each tp rank holds a sequence shard: its share of the mean is local / tp.
        return local / jax.lax.axis_size("tp") if sequence_parallel else local

    step = make_train_step(ddp, opt, loss_fn, num_microbatches=2)
    tx = optax.adamw(0.01, weight_decay=0.1, mask=jax.tree.map(lambda a: a.ndim > 1, ref))
    ref_opt = tx.init(ref)
    ref_loss = lambda p, x: jnp.mean(jnp.tanh(dense_parallel_mlp(p, jnp.swapaxes(x, 0, 1))) ** 2)
    for x in xs:
        params, opt_state, metrics = step(params, opt_state, jnp.asarray(x))
        g = jax.grad(ref_loss)(ref, x)
        norm = optax.tree.norm(g)
        np.testing.assert_allclose(float(metrics["grad_norm"]), float(norm), rtol=1e-5)
        assert float(norm) > 0.01  # clipping is active
        g = jax.tree.map(lambda t: t * clip_coefficient(norm, 0.01), g)
        updates, ref_opt = tx.update(g, ref_opt, ref)
        ref = optax.apply_updates(ref, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6), params, ref)
