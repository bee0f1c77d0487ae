"""Megatron DDP options: the partial distributed optimizer (num_distributed_optimizer_instances),
check_for_large_grads, reduce_scatter_with_fp32_accumulation, align_param_gather; config
validation and field docstrings. 8 simulated devices, fp32 (one-device references)."""

import ast
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ddp_models import MLP, make_batch, mse_loss, reference_train
from jax.sharding import PartitionSpec as P
from tp_harness import dense_parallel_mlp

from core import parallel_state as ps
from core.distributed import distributed_data_parallel_config as config_module
from core.distributed import param_and_grad_buffer
from core.distributed.collectives import (
    hlo_collective_bytes,
    reduce_scatter,
    reduce_scatter_with_fp32_accumulation,
)
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.grad_sync import (
    LARGE_GRAD_NUM_SAMPLES,
    LargeGradientError,
    instance_groups,
    reduce_gradient_buckets,
)
from core.distributed.param_and_grad_buffer import bucket_element_masks, bucket_shard_ranges, build_buffer_specs
from core.optimizer import distrib_optimizer, get_megatron_optimizer
from core.optimizer.clip_grads import clip_coefficient
from core.optimizer.optimizer_config import OptimizerConfig
from core.param_metadata import ParamInfo
from core.training.train_step import make_train_step
from core.transformer.mlp import ParallelMLP

GLOBAL_BATCH = 32
STEPS = 3


# -- config ------------------------------------------------------------------------------

def test_every_config_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(config_module.DistributedDataParallelConfig))
    body = tree.body[0].body
    documented = {stmt.target.id for stmt, nxt in zip(body, body[1:])
                  if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)}
    fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    assert fields == documented
    assert {"num_distributed_optimizer_instances", "check_for_large_grads", "reduce_scatter_with_fp32_accumulation",
            "align_param_gather"} <= fields


@pytest.mark.parametrize("kwargs,message", [
    ({"num_distributed_optimizer_instances": 2}, "needs use_distributed_optimizer=True"),
    ({"num_distributed_optimizer_instances": 0, "use_distributed_optimizer": True}, "positive int"),
    ({"num_distributed_optimizer_instances": 2.0, "use_distributed_optimizer": True}, "positive int"),
    ({"num_distributed_optimizer_instances": 2, "use_distributed_optimizer": True,
      "reduce_scatter_with_fp32_accumulation": True}, "not supported with num_distributed_optimizer_instances=2"),
    ({"overlap_param_gather": True}, "overlap_param_gather needs use_distributed_optimizer"),
    ({"align_param_gather": True, "overlap_param_gather": True}, "overlap_param_gather needs use_distributed_optimizer"),
])
def test_invalid_combinations_are_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        DistributedDataParallelConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_align_param_gather_is_accepted_as_in_megatron():
    # Megatron consults it only with overlap_param_gather (its CLI default is True): accepted alone.
    assert DistributedDataParallelConfig(align_param_gather=True).align_param_gather
    DistributedDataParallelConfig(align_param_gather=True, overlap_param_gather=True, overlap_grad_reduce=True,
                                  use_distributed_optimizer=True)


def test_instances_must_divide_data_parallelism():
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=3)
    with pytest.raises(ValueError, match=r"size 8 is not divisible by num_distributed_optimizer_instances=3"):
        cfg.intra_instance_size(8)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=4)
    assert cfg.intra_instance_size(8, 4) == 2
    with pytest.raises(ValueError, match=r"expert data-parallel size 2 is not divisible"):
        cfg.intra_instance_size(8, 2)
    module = MLP()
    ddp = DistributedDataParallel(ps.build_parallel_state(), DistributedDataParallelConfig(
        use_distributed_optimizer=True, num_distributed_optimizer_instances=3), module)
    with pytest.raises(ValueError, match="not divisible by num_distributed_optimizer_instances=3"):
        ddp.init(jax.random.key(0), jnp.zeros((2, 8)))


def test_instance_groups_are_megatrons_contiguous_intra_and_strided_inter_groups():
    intra, inter = instance_groups(8, 2)
    assert intra == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert instance_groups(8, 1) == (None, None)


# -- partial distributed optimizer ---------------------------------------------------------

def _run(state, ddp_config, opt_config, steps=STEPS, num_microbatches=2):
    """Train the MLP; returns (optimizer, params, optimizer state, losses); ``optimizer.model`` is the DDP."""
    module = MLP()
    ddp = DistributedDataParallel(state, ddp_config, module)
    opt = get_megatron_optimizer(opt_config, [ddp])
    params = ddp.init(jax.random.key(0), jnp.asarray(make_batch(GLOBAL_BATCH)[0][:2]))
    opt_state = opt.init_state(params)
    losses = []
    if not steps:
        return opt, params, opt_state, losses
    step = make_train_step(ddp, opt, mse_loss(module), num_microbatches)
    for i in range(steps):
        params, opt_state, metrics = step(params, opt_state, ddp.shard_batch(make_batch(GLOBAL_BATCH, seed=i)))
        losses.append(float(metrics["loss"]))
    return opt, params, opt_state, losses


def _assert_replicas_identical(tree):
    for leaf in jax.tree.leaves(tree):
        copies = [np.asarray(s.data) for s in leaf.addressable_shards if s.replica_id >= 0]
        by_index = {}
        for s, c in zip(leaf.addressable_shards, copies, strict=True):
            by_index.setdefault(str(s.index), []).append(c)
        for same in by_index.values():
            for c in same[1:]:
                np.testing.assert_array_equal(c, same[0])


def test_partial_distributed_optimizer_dp8_equals_full_and_single_device():
    state = ps.build_parallel_state()
    opt_config = OptimizerConfig(optimizer="adam", lr=0.01, weight_decay=0.1, clip_grad=0.5)  # clipping active
    full = _run(state, DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=300), opt_config)
    module = MLP()
    ref_params = module.init(jax.random.key(0), jnp.asarray(make_batch(GLOBAL_BATCH)[0][:2]))
    ref_params, ref_losses = reference_train(
        module, ref_params, [tuple(map(jnp.asarray, make_batch(GLOBAL_BATCH, seed=i))) for i in range(STEPS)],
        opt_config)
    numel = {}
    for instances in (2, 4, 8):  # 8 = dp: every rank holds the whole state (no training run)
        cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=300,
                                            num_distributed_optimizer_instances=instances)
        opt, params, opt_state, losses = _run(state, cfg, opt_config, steps=0 if instances == 8 else STEPS)
        numel[instances] = opt.state_bytes_per_device(opt_state)
        if instances == 8:
            continue
        assert len(opt.model.buffer_specs[0].layout.bucket_indices) > 1
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        np.testing.assert_allclose(losses, full[3], rtol=1e-6)
        for other in (ref_params, full[1]):
            jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                         params, other)
        _assert_replicas_identical(params)  # the instances' copies of every shard stay identical
    numel[1] = full[0].state_bytes_per_device(full[2])
    # State per device scales with the instance size dp/instances (padding lcm(g, 128) = 128 here).
    for instances in (2, 4, 8):
        assert abs(numel[instances] - instances * numel[1]) <= 64, numel


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_buckets_cut_at_the_int32_cap_train_as_one_bucket(monkeypatch, use_distributed_optimizer):
    # The cap on a bucket's elements (int32 indexing, 2**31 - 2**20 in real runs) made small, so
    # that a buffer that would be one bucket (no bucket_size) becomes several: same training.
    state = ps.build_parallel_state()
    opt_config = OptimizerConfig(optimizer="adam", lr=0.01, weight_decay=0.1, clip_grad=0.5)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer)
    whole = _run(state, cfg, opt_config)
    assert len(whole[0].model.buffer_specs[0].layout.bucket_indices) == 1
    monkeypatch.setattr(param_and_grad_buffer, "MAX_BUCKET_ELEMENTS", 1024)
    opt, params, _, losses = _run(state, cfg, opt_config)
    sizes = opt.model.buffer_specs[0].bucket_sizes()
    assert len(sizes) > 1 and max(sizes) <= 1024, sizes
    np.testing.assert_allclose(losses, whole[3], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7),
                 params, whole[1])


@pytest.mark.parametrize("max_flips", [distrib_optimizer.FLAG_COMPARE_MAX_FLIPS, 0])  # comparisons; cumsum
def test_shard_flags_are_each_ranks_slice_of_the_element_masks(monkeypatch, max_flips):
    # The distributed optimizer's weight-decay and norm flags are computed per shard from where
    # they flip in a bucket, not stored per element: on every rank (two instances of 4: shard
    # r mod 4) they equal that rank's slice of the per-element masks on every parameter element.
    monkeypatch.setattr(distrib_optimizer, "FLAG_COMPARE_MAX_FLIPS", max_flips)
    state = ps.build_parallel_state()
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=300,
                                        num_distributed_optimizer_instances=2)
    opt, _, _, losses = _run(state, cfg, OptimizerConfig(optimizer="adam", lr=0.01, weight_decay=0.1, clip_grad=0.5))
    ddp, opt = opt.model, opt.inner
    spec = opt.specs[0]
    flags = [i % 3 != 1 for i in range(len(opt.flags.decay))]  # flips inside buckets (the decay flag has some too)
    buckets = range(len(spec.layout.bucket_indices))
    fn = lambda: tuple(jnp.broadcast_to(opt._shard_flags(spec, b, flags), (s // 4,))[None]
                       for b, s in zip(buckets, spec.bucket_sizes(), strict=True))
    got = jax.jit(ddp.shard_map(fn, (), (ddp.local_spec,) * len(buckets)))()
    masks = bucket_element_masks(spec, [flags[i] for i in spec.leaves])
    param_elements = bucket_element_masks(spec, [True] * len(spec.leaves))
    assert sum(len(distrib_optimizer.bucket_flag_changes(spec, b, [flags[i] for i in spec.leaves])[1])
               for b in buckets) > 2
    for b in buckets:
        start = spec.layout.bucket_indices[b][0]
        for rank in range(8):
            lo, hi = (x - start for x in bucket_shard_ranges(spec.layout, 4, rank % 4)[b])
            inside = param_elements[b][lo:hi]
            np.testing.assert_array_equal(np.asarray(got[b])[rank][inside], masks[b][lo:hi][inside])
    # Training through the same path equals the one-device reference (as the test above checks
    # for the default path).
    module = MLP()
    ref_params = module.init(jax.random.key(0), jnp.asarray(make_batch(GLOBAL_BATCH)[0][:2]))
    _, ref_losses = reference_train(
        module, ref_params, [tuple(map(jnp.asarray, make_batch(GLOBAL_BATCH, seed=i))) for i in range(STEPS)],
        OptimizerConfig(optimizer="adam", lr=0.01, weight_decay=0.1, clip_grad=0.5))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_partial_distributed_optimizer_tp2_dp4_equals_dense():
    S, B, H, F = 8, 8, 16, 32
    state = ps.build_parallel_state(2)
    module = ParallelMLP(H, F)
    cfg = OptimizerConfig(optimizer="adam", lr=0.01, weight_decay=0.1, clip_grad=0.01)
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(
        use_distributed_optimizer=True, num_distributed_optimizer_instances=2), module)
    opt = get_megatron_optimizer(cfg, [ddp])
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(B, S, H)).astype(np.float32) for _ in range(STEPS)]
    params = ddp.init(jax.random.key(0), jnp.zeros((S, 1, H)))
    ref = jax.tree.map(np.asarray, params)
    opt_state = opt.init_state(params)
    step = make_train_step(ddp, opt, lambda p, x: jnp.mean(jnp.tanh(module.apply(p, jnp.swapaxes(x, 0, 1))) ** 2), 2)
    tx = optax.adamw(0.01, weight_decay=0.1, mask=jax.tree.map(lambda a: a.ndim > 1, ref))
    ref_opt = tx.init(ref)
    ref_loss = lambda p, x: jnp.mean(jnp.tanh(dense_parallel_mlp(p, jnp.swapaxes(x, 0, 1))) ** 2)
    for x in xs:
        params, opt_state, metrics = step(params, opt_state, jnp.asarray(x))
        g = jax.grad(ref_loss)(ref, x)
        norm = optax.tree.norm(g)
        np.testing.assert_allclose(float(metrics["grad_norm"]), float(norm), rtol=1e-5)
        g = jax.tree.map(lambda t: t * clip_coefficient(norm, 0.01), g)
        updates, ref_opt = tx.update(g, ref_opt, ref)
        ref = optax.apply_updates(ref, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6), params, ref)
    _assert_replicas_identical(params)
    # The layout-independent form (checkpoints): the instance's shards gathered into per-parameter
    # Adam moments equal to optax's on the whole tree; back into shards bit-exactly.
    full = opt.state_to_global(opt_state)
    for ours, theirs in ((full["inner"][0].mu, ref_opt[0].mu), (full["inner"][0].nu, ref_opt[0].nu)):
        for a, b in zip(ours, jax.tree.leaves(theirs), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 opt.state_from_global(full), opt_state)


def _reduce(state, ddp_config, values_per_rank, dtype=jnp.float32, size=(64, 4)):
    """Reduce one dense and one expert buffer whose grads on rank r are values_per_rank(r)."""
    shapes = [size, (128,)]
    infos = [ParamInfo(P()), ParamInfo(P(), expert=True)]
    dp = ddp_config.intra_instance_size(state.replica_size(expert=False), state.replica_size(expert=True))
    specs = build_buffer_specs(shapes, [dtype] * 2, infos, data_parallel_size=dp, bucket_size=None,
                               use_distributed_optimizer=True, grad_reduce_in_fp32=ddp_config.grad_reduce_in_fp32)
    names = state.mesh.axis_names

    def body(rank):
        r = rank.reshape(())
        buffers = [tuple(values_per_rank(r, n).astype(jnp.dtype(s.key.grad_dtype)) for n in s.bucket_sizes())
                   for s in specs]
        return jax.tree.map(lambda x: x[None, None, None, None, None],
                            reduce_gradient_buckets(buffers, specs, ddp_config, state))

    fn = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=P(*names), out_specs=P(*names), check_vma=False))
    ranks = jnp.asarray(state.device_ranks, jnp.float32)
    return specs, fn, fn(ranks), ranks


def test_partial_reduction_groups_dense_and_expert():
    # ep=2, 2 instances: dense grads reduce over all 8 dp ranks, shards of 1/4 of a bucket inside
    # each instance of 4 contiguous dp ranks; expert grads over the 4 expert-dp ranks, shards of 1/2.
    state = ps.build_parallel_state(expert_model_parallel_size=2)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    specs, _, (dense, expert), _ = _reduce(state, cfg, lambda r, n: jnp.full(n, 2.0**r))
    by_rank = {int(r): i for i, r in enumerate(state.device_ranks.ravel())}
    for rank in range(8):
        d = by_rank[rank]
        want_dense = sum(2.0**r for r in state.group_of(rank, state.data_parallel_axis_name)) / 8
        want_expert = sum(2.0**r for r in state.group_of(rank, ("dp",))) / 8
        assert np.asarray(dense[0]).reshape(8, -1).shape[1] == specs[0].bucket_sizes()[0] // 4
        assert np.asarray(expert[0]).reshape(8, -1).shape[1] == specs[1].bucket_sizes()[0] // 2
        np.testing.assert_allclose(np.asarray(dense[0]).reshape(8, -1)[d], want_dense)
        np.testing.assert_allclose(np.asarray(expert[0]).reshape(8, -1)[d], want_expert)


def test_partial_reduction_groups_with_context_parallelism():
    # cp=2, ep=2 (dp 4, expert dp 2), 4 instances: dense grads reduce over dp x cp = 8 ranks in
    # instances of 2; expert grads over expert-dp x cp = 4 ranks, one rank per instance (the
    # whole bucket, all-reduced across the instances). Before, the instance check took expert
    # dp alone (2) and refused this layout.
    state = ps.build_parallel_state(context_parallel_size=2, expert_model_parallel_size=2)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=4)
    specs, _, (dense, expert), _ = _reduce(state, cfg, lambda r, n: jnp.full(n, 2.0**r))
    by_rank = {int(r): i for i, r in enumerate(state.device_ranks.ravel())}
    for rank in range(8):
        d = by_rank[rank]
        want_dense = sum(2.0**r for r in state.group_of(rank, state.replica_axes(expert=False))) / 8
        expert_group = state.group_of(rank, state.replica_axes(expert=True))
        assert len(expert_group) == 4
        want_expert = sum(2.0**r for r in expert_group) / 8
        assert np.asarray(dense[0]).reshape(8, -1).shape[1] == specs[0].bucket_sizes()[0] // 2
        assert np.asarray(expert[0]).reshape(8, -1).shape[1] == specs[1].bucket_sizes()[0]
        np.testing.assert_allclose(np.asarray(dense[0]).reshape(8, -1)[d], want_dense)
        np.testing.assert_allclose(np.asarray(expert[0]).reshape(8, -1)[d], want_expert)


# -- reduce_scatter_with_fp32_accumulation ---------------------------------------------------

def test_fp32_accumulation_is_closer_to_the_exact_sum_than_a_bf16_ring():
    state = ps.build_parallel_state()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 8 * 2048)), jnp.bfloat16)
    exact = np.asarray(x, np.float64).sum(0)

    def run(f):
        fn = jax.jit(jax.shard_map(lambda v: f(v[0])[None], mesh=state.mesh, in_specs=P(state.mesh.axis_names),
                                   out_specs=P(state.mesh.axis_names), check_vma=False))
        return np.asarray(fn(x).astype(jnp.float32), np.float64).reshape(-1)  # row r on dp rank r

    axes = state.data_parallel_axis_name
    accumulated = np.abs(run(lambda v: reduce_scatter_with_fp32_accumulation(v, axes).astype(jnp.bfloat16)) - exact)
    ring = np.abs(run(lambda v: reduce_scatter(v, axes, impl="ring")) - exact)  # CPU multi-process path, NCCL-like
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - 7)  # bf16: 8 significant bits
    assert np.all(accumulated <= 0.5 * ulp * (1 + 1e-6))  # one rounding of the exact sum
    assert accumulated.mean() < 0.6 * ring.mean()
    # Returned in fp32 it is the fp32 sum of the bf16 inputs.
    np.testing.assert_allclose(run(lambda v: reduce_scatter_with_fp32_accumulation(v, axes)), exact, rtol=1e-6)


def test_fp32_accumulation_halves_reduce_scatter_traffic_and_matches_fp32_reduction():
    state = ps.build_parallel_state()
    # bf16-representable values, so both reduce the same numbers.
    values = lambda r, n: (jnp.sin(jnp.arange(n, dtype=jnp.float32) + r) * (1 + r)).astype(jnp.bfloat16)
    traffic, results = {}, {}
    for name, cfg in {
        "fp32 grads": DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        "bf16 grads, fp32 accumulation": DistributedDataParallelConfig(
            use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=True),
    }.items():
        _, fn, out, ranks = _reduce(state, cfg, values, dtype=jnp.bfloat16, size=(1024, 8))
        traffic[name] = hlo_collective_bytes(fn.lower(ranks).compile().as_text(), 8)
        results[name] = np.asarray(out[0][0], np.float32)
    assert set(traffic["fp32 grads"]) == {"reduce-scatter"}
    assert set(traffic["bf16 grads, fp32 accumulation"]) == {"all-to-all"}
    elements = (1024 * 8 + 128)  # one bucket per buffer, padded to 128
    assert traffic["fp32 grads"]["reduce-scatter"] == 4 * elements * 7 // 8
    assert traffic["bf16 grads, fp32 accumulation"]["all-to-all"] == 2 * elements * 7 // 8
    # The same sum, rounded once to bf16.
    np.testing.assert_allclose(results["bf16 grads, fp32 accumulation"], results["fp32 grads"], rtol=2**-8, atol=1e-6)


def test_fp32_accumulation_ddp_equals_plain_distributed_optimizer():
    state = ps.build_parallel_state()
    opt_config = OptimizerConfig(optimizer="sgd", lr=0.05)
    base = _run(state, DistributedDataParallelConfig(use_distributed_optimizer=True, average_in_collective=True),
                opt_config, steps=2)[1]
    other = _run(state, DistributedDataParallelConfig(use_distributed_optimizer=True, average_in_collective=True,
                                                      reduce_scatter_with_fp32_accumulation=True), opt_config, steps=2)[1]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7),
                 base, other)


# -- check_for_large_grads -------------------------------------------------------------------

@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_large_grad_is_flagged_after_warm_up_skipped_and_named(use_distributed_optimizer):
    state = ps.build_parallel_state()
    module = MLP()
    # bucket_size=1: one bucket per parameter, 8 checks per step: 100 warm-up samples take 12.5 steps.
    cfg = DistributedDataParallelConfig(check_for_large_grads=True, bucket_size=1,
                                        use_distributed_optimizer=use_distributed_optimizer)
    ddp = DistributedDataParallel(state, cfg, module)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [ddp])
    x0, _ = make_batch(GLOBAL_BATCH)
    params = ddp.init(jax.random.key(0), jnp.asarray(x0[:2]))
    opt_state = opt.init_state(params)
    step = make_train_step(ddp, opt, mse_loss(module))
    buckets = len(ddp.buffer_specs[0].layout.bucket_indices)
    assert buckets == 8
    for i in range(LARGE_GRAD_NUM_SAMPLES // buckets + 2):  # warm-up, then normal steps are checked
        params, opt_state, metrics = step(params, opt_state, ddp.shard_batch(make_batch(GLOBAL_BATCH, seed=i)))
        assert not bool(metrics["skipped"])
        assert not np.asarray(metrics["large_grads"]["flags"]).any()
        opt.check_nonfinite(metrics)
    tracker = jax.tree.map(np.asarray, opt_state["large_grads"])
    assert (tracker["count"] == LARGE_GRAD_NUM_SAMPLES).all() and (tracker["max"] > 0).all()
    x, y = make_batch(GLOBAL_BATCH, seed=99)
    y[20:24] *= 1e4  # rows 20..23: data-parallel rank 5 only
    before = jax.tree.map(np.asarray, (params, opt_state))
    params, opt_state, metrics = step(params, opt_state, ddp.shard_batch((x, y)))
    assert bool(metrics["skipped"])
    flags = np.asarray(metrics["large_grads"]["flags"])
    assert flags[5].any() and not np.delete(flags, 5, axis=0).any()
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, (params, opt_state)), before)
    with pytest.raises(LargeGradientError, match=r"rank 5: bucket #\d+ of the float32 buffer, local grad norm .* >= 10 x "
                                                 r".*params\['params'\]\['layer_03'\]\['kernel'\].*unchanged"):
        opt.check_nonfinite(metrics)
