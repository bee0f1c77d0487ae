"""Partial distributed optimizer (num_distributed_optimizer_instances=2) across 8 real processes
equals one-device training; the two instances' copies stay bit-identical."""

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
STEPS = 3


def test_partial_distributed_optimizer_8_processes_equals_single_device():
    from jax.experimental import multihost_utils

    state = ps.initialize_model_parallel()
    module = MLP()
    cfg = OptimizerConfig(optimizer="adam", lr=0.01, weight_decay=0.1, clip_grad=0.5)
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(
        use_distributed_optimizer=True, num_distributed_optimizer_instances=2, bucket_size=300), module)
    opt = get_megatron_optimizer(cfg, [ddp])
    x0 = jnp.asarray(make_batch(GLOBAL_BATCH)[0][:2])
    params = ddp.init(jax.random.key(0), x0)
    opt_state = opt.init_state(params)
    step = make_train_step(ddp, opt, mse_loss(module), 2)
    r, n = jax.process_index(), jax.process_count()
    per = GLOBAL_BATCH // n
    losses = []
    for i in range(STEPS):
        local = tuple(a[r * per:(r + 1) * per] for a in make_batch(GLOBAL_BATCH, seed=i))
        params, opt_state, metrics = step(params, opt_state, ddp.shard_batch(local))
        losses.append(float(metrics["loss"]))
    ref_params, ref_losses = reference_train(module, module.init(jax.random.key(0), x0),
                                             [tuple(map(jnp.asarray, make_batch(GLOBAL_BATCH, seed=i)))
                                              for i in range(STEPS)], cfg)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    local = jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6), local, ref_params)
    for leaf in jax.tree.leaves(local):  # every process's copy is bit-identical
        copies = np.asarray(multihost_utils.process_allgather(leaf))
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])
    # Optimizer state: a shard of 1/4 of every bucket per process, the same on process p and p + 4.
    shards = [np.asarray(multihost_utils.process_allgather(x.addressable_shards[0].data))
              for x in jax.tree.leaves(opt_state["inner"]) if x.ndim > 1]
    for s in shards:
        np.testing.assert_array_equal(s[:4], s[4:])
        assert not np.array_equal(s[0], s[1])
