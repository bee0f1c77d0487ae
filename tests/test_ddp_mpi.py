"""DDP across 8 real processes equals one-device training; NaN detection across processes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ddp_models import MLP, make_batch, mse_loss, reference_train

from core import parallel_state as ps
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.optimizer import get_megatron_optimizer
from core.optimizer.optimizer_config import OptimizerConfig
from core.training.train_step import make_train_step

pytestmark = pytest.mark.mpi(min_size=8)
GLOBAL_BATCH = 32
STEPS = 5


def _local_rows(batch):
    """This process's rows of a global batch (its data-parallel slice)."""
    r, n = jax.process_index(), jax.process_count()
    per = GLOBAL_BATCH // n
    return tuple(a[r * per:(r + 1) * per] for a in batch)


@pytest.mark.parametrize("use_distributed_optimizer,num_microbatches,bucket_size,optimizer", [
    (False, 1, None, "adam"),
    (True, 4, 300, "adam"),
    (True, 1, 300, "sgd"),
])
def test_ddp_dp8_processes_equal_single_device(use_distributed_optimizer, num_microbatches, bucket_size, optimizer):
    state = ps.initialize_model_parallel()
    module = MLP()
    cfg = OptimizerConfig(optimizer=optimizer, lr=0.01, weight_decay=0.1, clip_grad=0.5 if optimizer == "adam" else 0.0)
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer, bucket_size=bucket_size), module)
    opt = get_megatron_optimizer(cfg, [ddp])
    x0 = jnp.asarray(make_batch(GLOBAL_BATCH)[0][:2])
    params = ddp.init(jax.random.key(0), x0)
    opt_state = opt.init_state(params)
    step = make_train_step(ddp, opt, mse_loss(module), num_microbatches)
    losses = []
    for i in range(STEPS):
        params, opt_state, metrics = step(params, opt_state, ddp.shard_batch(_local_rows(make_batch(GLOBAL_BATCH, seed=i))))
        losses.append(float(metrics["loss"]))
    ref_params, ref_losses = reference_train(module, module.init(jax.random.key(0), x0),
                                             [tuple(map(jnp.asarray, make_batch(GLOBAL_BATCH, seed=i))) for i in range(STEPS)], cfg)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    local = jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6), local, ref_params)
    # Every process's copy is bit-identical (the replicated optimizer clips with a norm each
    # process computes from its own copy of the reduced grads).
    from jax.experimental import multihost_utils

    for leaf in jax.tree.leaves(local):
        copies = np.asarray(multihost_utils.process_allgather(leaf))
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])


def test_nan_on_one_process_is_reported_on_every_process():
    state = ps.initialize_model_parallel()
    module = MLP()
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(check_for_nan_in_grad=True,
                                                                       use_distributed_optimizer=True), module)
    opt = get_megatron_optimizer(OptimizerConfig(), [ddp])
    x, y = make_batch(GLOBAL_BATCH)
    params = ddp.init(jax.random.key(0), jnp.asarray(x[:2]))
    opt_state = opt.init_state(params)
    x[21, 3] = np.inf  # rank 5's rows are 20..23
    before = jax.tree.map(jnp.copy, params)  # the step donates params
    params2, _, metrics = make_train_step(ddp, opt, mse_loss(module))(params, opt_state, ddp.shard_batch(_local_rows((x, y))))
    assert bool(metrics["skipped"])
    with pytest.raises(FloatingPointError, match=r"rank 5: params\['params'\]\['layer_00'\]\['kernel'\]"):
        opt.check_nonfinite(metrics)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a.addressable_shards[0].data),
                                                            np.asarray(b.addressable_shards[0].data)), params2, before)
