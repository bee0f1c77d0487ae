"""DistributedDataParallel on 8 simulated devices equals one-device training."""

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

STEPS = 5
GLOBAL_BATCH = 32


def _run_ddp(state, ddp_config, opt_config, num_microbatches, steps=STEPS):
    module = MLP()
    ddp = DistributedDataParallel(state, ddp_config, module)
    opt = get_megatron_optimizer(opt_config, [ddp])
    x0, _ = make_batch(GLOBAL_BATCH)
    params = ddp.init(jax.random.key(0), jnp.asarray(x0[:2]))
    opt_state = opt.init_state(params)
    step = make_train_step(ddp, opt, mse_loss(module), num_microbatches)
    losses = []
    for i in range(steps):
        params, opt_state, metrics = step(params, opt_state, ddp.shard_batch(make_batch(GLOBAL_BATCH, seed=i)))
        losses.append(float(metrics["loss"]))
    return ddp, opt, params, opt_state, losses


# Every pair of option values appears in some row (a pairwise covering set of the 24 combinations),
# plus the two heaviest rows (distributed optimizer, buckets, microbatches, Adam's clipping).
DP8_CASES = [(False, 1, None, "adam"), (False, 4, 300, "sgd"), (True, 1, 300, "sgd"), (True, 4, None, "adam"),
             ("overlap", 1, None, "sgd"), ("overlap", 4, 300, "adam"), (True, 4, 300, "adam"),
             ("overlap", 4, None, "adam")]


@pytest.mark.parametrize("use_distributed_optimizer,num_microbatches,bucket_size,optimizer", DP8_CASES)
def test_ddp_dp8_equals_single_device(use_distributed_optimizer, num_microbatches, bucket_size, optimizer):
    state = ps.build_parallel_state()
    overlap = use_distributed_optimizer == "overlap"  # per-bucket param gathers, unrolled last microbatch
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=bool(use_distributed_optimizer),
                                               bucket_size=bucket_size, overlap_grad_reduce=overlap,
                                               overlap_param_gather=overlap)
    # SGD without clipping is sensitive to the grad scale, Adam with active clipping to the norm.
    opt_config = OptimizerConfig(optimizer=optimizer, lr=0.01, weight_decay=0.1, clip_grad=0.5 if optimizer == "adam" else 0.0)
    ddp, _, params, _, losses = _run_ddp(state, ddp_config, opt_config, num_microbatches)
    if bucket_size:
        assert len(ddp.buffer_specs[0].layout.bucket_indices) > 1
    module = MLP()
    ref_params = module.init(jax.random.key(0), jnp.asarray(make_batch(GLOBAL_BATCH)[0][:2]))
    batches = [tuple(map(jnp.asarray, make_batch(GLOBAL_BATCH, seed=i))) for i in range(STEPS)]
    ref_params, ref_losses = reference_train(module, ref_params, batches, opt_config)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 params, ref_params)


def test_distributed_optimizer_state_is_sharded():
    state = ps.build_parallel_state()
    cfg = OptimizerConfig(optimizer="adam")
    _, rep_opt, _, opt_rep, _ = _run_ddp(state, DistributedDataParallelConfig(), cfg, 1, steps=0)
    _, dist_opt, _, opt_dist, _ = _run_ddp(state, DistributedDataParallelConfig(use_distributed_optimizer=True), cfg, 1, steps=0)
    rep = rep_opt.state_bytes_per_device(opt_rep)
    dist = dist_opt.state_bytes_per_device(opt_dist)
    numel = sum(int(np.prod(s)) for spec in rep_opt.model.buffer_specs for s in spec.shapes)
    assert rep >= 8 * numel  # Adam: two fp32 moments per param
    padded = sum(spec.layout.numel for spec in dist_opt.model.buffer_specs)
    assert dist <= rep / 8 * padded / numel + 64


@pytest.mark.parametrize("average_in_collective", [False, True])
def test_average_in_collective_matches_prescaling(average_in_collective):
    state = ps.build_parallel_state()
    cfg = OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.0, sgd_momentum=0.0)
    base = _run_ddp(state, DistributedDataParallelConfig(), cfg, 2, steps=2)[2]
    other = _run_ddp(state, DistributedDataParallelConfig(average_in_collective=average_in_collective), cfg, 2, steps=2)[2]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), base, other)


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_nan_grad_skips_update_and_names_param_and_rank(use_distributed_optimizer):
    state = ps.build_parallel_state()
    module = MLP()
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(
        check_for_nan_in_grad=True, use_distributed_optimizer=use_distributed_optimizer), module)
    opt = get_megatron_optimizer(OptimizerConfig(), [ddp])
    x, y = make_batch(GLOBAL_BATCH)
    params = ddp.init(jax.random.key(0), jnp.asarray(x[:2]))
    opt_state = opt.init_state(params)
    before = jax.tree.map(np.asarray, (params, opt_state))
    x[13, 0] = np.nan  # row 13 of 32 lives on data-parallel rank 3
    step = make_train_step(ddp, opt, mse_loss(module))
    params, opt_state, metrics = step(params, opt_state, ddp.shard_batch((x, y)))
    assert bool(metrics["skipped"])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, (params, opt_state)), before)
    with pytest.raises(FloatingPointError, match=r"rank 3: params\['params'\]\['layer_00'\]\['kernel'\].*unchanged"):
        opt.check_nonfinite(metrics)
    ok = make_train_step(ddp, opt, mse_loss(module))(params, opt_state, ddp.shard_batch(make_batch(GLOBAL_BATCH)))[2]
    assert not bool(ok["skipped"])
    opt.check_nonfinite(ok)


def test_replicated_params_stay_bit_identical_across_data_parallel_ranks():
    # The replicated optimizer computes the clipping norm on every rank from its own copy of the
    # reduced grads, with no collective: the copies, norms and updates must agree bit for bit.
    state = ps.build_parallel_state()
    cfg = OptimizerConfig(optimizer="adam", lr=0.01, clip_grad=0.05)
    module = MLP()
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(), module)
    opt = get_megatron_optimizer(cfg, [ddp])
    params = ddp.init(jax.random.key(0), jnp.asarray(make_batch(GLOBAL_BATCH)[0][:2]))
    opt_state = opt.init_state(params)
    step = make_train_step(ddp, opt, mse_loss(module), 2)
    for i in range(STEPS):
        params, opt_state, metrics = step(params, opt_state, ddp.shard_batch(make_batch(GLOBAL_BATCH, seed=i)))
        assert float(metrics["grad_norm"]) > cfg.clip_grad  # clipping is active
    for leaf in jax.tree.leaves((params, opt_state)):
        copies = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(copies) == 8
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])


def test_overflowing_grad_norm_without_nonfinite_grads_is_explained():
    state = ps.build_parallel_state()
    module = MLP()
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(check_for_nan_in_grad=True), module)
    opt = get_megatron_optimizer(OptimizerConfig(), [ddp])
    ddp.init(jax.random.key(0), jnp.asarray(make_batch(GLOBAL_BATCH)[0][:2]))
    metrics = {"skipped": np.bool_(True), "nonfinite": np.zeros((8, len(ddp.param_paths)), bool)}
    with pytest.raises(FloatingPointError, match="sum of squares overflowed"):
        opt.check_nonfinite(metrics)


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_megatron_facade_equals_fused_step(use_distributed_optimizer):
    state = ps.build_parallel_state()
    module = MLP()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer, bucket_size=300)
    opt_config = OptimizerConfig(optimizer="sgd", lr=0.05, clip_grad=0.0)
    ddp = DistributedDataParallel(state, ddp_config, module)
    opt = get_megatron_optimizer(opt_config, [ddp])
    x, y = make_batch(GLOBAL_BATCH)
    params = ddp.init(jax.random.key(0), jnp.asarray(x[:2]))
    fused_step = make_train_step(ddp, opt, mse_loss(module), 2)  # donates its inputs: give it a copy
    fused_params, _, metrics = fused_step(jax.tree.map(jnp.copy, params), opt.init_state(params),
                                          ddp.shard_batch((x, y)))
    # Megatron's loop: zero, accumulate microbatches under no_sync, last one syncs, step.
    ddp.zero_grad_buffer()
    # Every rank's 4 rows split in two halves (not the fused step's split: losses are means).
    micro = [(np.concatenate([x[r * 4:(r + 1) * 4][k::2] for r in range(8)]),
              np.concatenate([y[r * 4:(r + 1) * 4][k::2] for r in range(8)])) for k in range(2)]
    with ddp.no_sync():
        ddp.backward(mse_loss(module), params, ddp.shard_batch(micro[0]), scale=0.5)
    ddp.backward(mse_loss(module), params, ddp.shard_batch(micro[1]), scale=0.5)
    ddp.params = params  # the fused step moved the facade to its output
    opt.init_state(params)
    assert opt.step()[0]
    facade_params = ddp.params
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
                 facade_params, fused_params)
    # broadcast_params keeps data-parallel rank 0's copy everywhere.
    synced = ddp.broadcast_params(facade_params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), synced, facade_params)


def test_per_token_loss_normalisation_matches_mean_loss():
    state = ps.build_parallel_state()
    module = MLP()
    cfg = OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.0, weight_decay=0.0)
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(), module)
    opt = get_megatron_optimizer(cfg, [ddp])
    x, y = make_batch(GLOBAL_BATCH)
    params = ddp.init(jax.random.key(0), jnp.asarray(x[:2]))

    def summed(p, batch):
        bx, by = batch
        err = (module.apply(p, bx) - by) ** 2
        return jnp.sum(err), jnp.asarray(err.size, jnp.float32), {}

    mean_step = make_train_step(ddp, opt, mse_loss(module), 2)
    token_step = make_train_step(ddp, opt, summed, 2, calculate_per_token_loss=True)
    a = mean_step(jax.tree.map(jnp.copy, params), opt.init_state(params), ddp.shard_batch((x, y)))
    b = token_step(params, opt.init_state(params), ddp.shard_batch((x, y)))
    np.testing.assert_allclose(float(a[2]["loss"]), float(b[2]["loss"]), rtol=1e-6)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-7), a[0], b[0])


def test_indivisible_batch_is_a_clear_error():
    state = ps.build_parallel_state()
    module = MLP()
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(), module)
    opt = get_megatron_optimizer(OptimizerConfig(), [ddp])
    x, y = make_batch(GLOBAL_BATCH)
    params = ddp.init(jax.random.key(0), jnp.asarray(x[:2]))
    step = make_train_step(ddp, opt, mse_loss(module), num_microbatches=3)
    with pytest.raises(ValueError, match=r"global batch 32 is not divisible by data_parallel_size \(8\) x num_microbatches \(3\)"):
        step(params, opt.init_state(params), ddp.shard_batch((x, y)))


def test_train_step_donates_state_and_makes_no_implicit_transfers():
    """A call with placed params, state and batch copies nothing between host and devices (the
    step has no constant array inputs: the distributed optimizer computes its weight-decay and
    norm flags per shard); params and optimizer state are donated (updated in place)."""
    state = ps.build_parallel_state()
    ddp, opt, params, opt_state, _ = _run_ddp(state, DistributedDataParallelConfig(), OptimizerConfig(), 1, steps=0)
    step = make_train_step(ddp, opt, mse_loss(ddp.module), 1)
    batch = ddp.shard_batch(make_batch(GLOBAL_BATCH, seed=1))
    params, opt_state, _ = step(params, opt_state, batch)  # compile outside the guard
    inputs = (params, opt_state)
    with jax.transfer_guard("disallow"):
        params, opt_state, metrics = step(params, opt_state, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert all(x.is_deleted() for x in jax.tree.leaves(inputs))
