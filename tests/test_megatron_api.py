"""Megatron's call forms on the package: package exports, the DDP facade
(``disable_bucketing``, ``forward``, ``state_dict``, ``scale_gradients`` after the sync, expert-safe
``broadcast_params``), ``finalize_model_grads(model_chunks, num_tokens)`` through the Megatron
loop example, and the rng that ``make_train_step`` hands the loss function."""

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ddp_models import MLP, make_batch, mse_loss
from jax.sharding import NamedSharding

from core import parallel_state as ps
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.optimizer import get_megatron_optimizer
from core.optimizer.optimizer_config import OptimizerConfig
from core.param_metadata import with_parallel_metadata
from core.training.train_step import make_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
GLOBAL_BATCH = 32
SGD = OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0)


def _mlp_ddp(ddp_config=None, opt_config=SGD, **kwargs):
    """The MLP wrapped in DDP and initialised: ``(ddp, optimizer, module, params, (x, y))``."""
    module = MLP()
    ddp = DistributedDataParallel(ps.build_parallel_state(), ddp_config or DistributedDataParallelConfig(), module, **kwargs)
    opt = get_megatron_optimizer(opt_config, [ddp])
    x, y = make_batch(GLOBAL_BATCH)
    params = ddp.init(jax.random.key(0), jnp.asarray(x[:2]))
    return ddp, opt, module, params, (x, y)


def test_package_exports_megatron_names():
    from core import distributed, optimizer, pipeline_parallel
    from core.distributed import DistributedDataParallel as DDP
    from core.distributed import DistributedDataParallelConfig as Config
    from core.distributed import finalize_model_grads
    from core.distributed.finalize_model_grads import finalize_model_grads as finalize
    from core.optimizer import DistributedOptimizer, OptimizerConfig
    from core.pipeline_parallel import PipelineModule, execute_pipeline, get_forward_backward_func
    from core.pipeline_parallel.gpipe import PipelineModule as PM
    from core.pipeline_parallel.schedules import get_forward_backward_func as gfb

    assert DDP is DistributedDataParallel and Config is DistributedDataParallelConfig
    assert finalize_model_grads is finalize and PipelineModule is PM and get_forward_backward_func is gfb
    assert callable(execute_pipeline) and DistributedOptimizer and OptimizerConfig
    for package in (distributed, optimizer, pipeline_parallel):
        for name in package.__all__:
            assert getattr(package, name) is not None, (package.__name__, name)


@pytest.mark.parametrize("first", ["core.distributed", "core.optimizer", "core.pipeline_parallel",
                                   "core.tensor_parallel"])
def test_package_imports_work_in_any_order(first):
    """No circular import whichever package a user imports first (a fresh interpreter)."""
    code = (f"import {first}\n"
            "from core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads\n"
            "from core.optimizer import DistributedOptimizer\n"
            "from core.pipeline_parallel import get_forward_backward_func, execute_pipeline, PipelineModule\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=120)


def test_scale_gradients_after_finish_grad_sync_scales_the_update():
    """Megatron's num_tokens path scales after finish_grad_sync: 0 leaves params, 0.5 halves SGD's step."""
    ddp, opt, module, params, (x, y) = _mlp_ddp()
    batch = ddp.shard_batch((x, y))
    moved = {}
    for factor in (1.0, 0.5, 0.0):
        ddp.zero_grad_buffer()
        ddp.backward(mse_loss(module), params, batch)  # outside no_sync: starts the sync
        ddp.finish_grad_sync()
        ddp.scale_gradients(factor)
        ddp.params = params
        opt.init_state(params)
        opt.step()
        new = ddp.params
        moved[factor] = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new, params)
    for leaf_full, leaf_half, leaf_zero in zip(*(jax.tree.leaves(moved[f]) for f in (1.0, 0.5, 0.0)), strict=True):
        assert np.abs(leaf_full).max() > 0
        np.testing.assert_array_equal(leaf_zero, 0.0)
        np.testing.assert_allclose(leaf_half, leaf_full / 2, rtol=1e-5, atol=1e-7)  # param differences


class _DenseAndExperts(nn.Module):
    """One dense kernel and one expert kernel split over ``ep`` (2 experts per ep rank)."""

    @nn.compact
    def __call__(self, x):
        dense = self.param("dense", with_parallel_metadata(nn.initializers.normal(), (None, None)), (4, 4))
        experts = self.param("experts", with_parallel_metadata(nn.initializers.normal(), ("ep", None, None),
                                                               expert=True), (2, 4, 4))
        return x @ dense + jnp.einsum("bi,eij->bj", x, experts)


def _per_device(leaf, value_of):
    """A global array whose shard on every device is ``value_of(device's global index, device)``:
    copies that differ across ranks, as after a load on one rank."""
    sharding = leaf.sharding
    base = np.asarray(leaf)
    arrays = [jax.device_put(value_of(base[idx], d), d) for d, idx in
              sharding.addressable_devices_indices_map(leaf.shape).items()]
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)


@pytest.mark.parametrize("cp", [1, 2])
def test_broadcast_params_keeps_each_ep_ranks_experts(cp):
    """ep=2, expert dp=4 / cp: dense params come from rank 0 of the data-parallel x context-parallel
    group, experts from rank 0 of the expert-data-parallel x cp group of the same ep rank (before,
    ep rank 0's experts overwrote ep rank 1's; and at cp 2 the cp ranks' experts went unsynced)."""
    state = ps.build_parallel_state(context_parallel_size=cp, expert_model_parallel_size=2)
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(), _DenseAndExperts())
    params = ddp.init(jax.random.key(0), jnp.ones((2, 4)))
    experts = params["params"]["experts"]  # the ep ranks' experts made distinct
    params["params"]["experts"] = jax.device_put(np.arange(experts.size, dtype=np.float32).reshape(experts.shape),
                                                 experts.sharding)
    ranks = {d: int(r) for d, r in zip(state.mesh.devices.flat, state.device_ranks.flat, strict=True)}

    def skew(leaf, expert):
        return _per_device(leaf, lambda v, d: v + 100 * state.group_rank(ranks[d], state.replica_axes(expert)))

    skewed = {"params": {"dense": skew(params["params"]["dense"], False),
                         "experts": skew(params["params"]["experts"], True)}}
    synced = ddp.broadcast_params(skewed)
    for name in ("dense", "experts"):
        want = np.asarray(params["params"][name])
        for shard in synced["params"][name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=name)


def test_partial_distributed_optimizer_instances_divide_the_expert_group_with_cp():
    # cp2 ep2: experts have dp / ep x cp = 4 copies, so 4 instances fit (expert dp alone is 2: refused before).
    state = ps.build_parallel_state(context_parallel_size=2, expert_model_parallel_size=2)
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(
        use_distributed_optimizer=True, num_distributed_optimizer_instances=4), _DenseAndExperts())
    opt = get_megatron_optimizer(SGD, [ddp])
    params = ddp.init(jax.random.key(0), jnp.ones((2, 4)))
    assert state.replica_size(expert=True) == 4 and opt.init_state(params) is not None


def test_disable_bucketing_puts_a_buffer_in_one_bucket():
    cfg = DistributedDataParallelConfig(bucket_size=300)
    bucketed, *_ = _mlp_ddp(cfg)
    single, *_ = _mlp_ddp(cfg, disable_bucketing=True)
    assert len(bucketed.buffer_specs[0].layout.bucket_indices) > 1
    assert [len(s.layout.bucket_indices) for s in single.buffer_specs] == [1]


def test_forward_state_dict_and_load_state_dict():
    ddp, opt, module, params, (x, _) = _mlp_ddp()
    np.testing.assert_array_equal(np.asarray(ddp(params, x)), np.asarray(module.apply(params, x)))
    np.testing.assert_array_equal(np.asarray(ddp.forward(params, x)), np.asarray(ddp(params, x)))
    sd = ddp.state_dict(params)
    assert sorted(sd) == sorted(f"params/layer_0{i}/{p}" for i in range(4) for p in ("bias", "kernel"))
    changed = {k: v + 1.0 for k, v in sd.items()}
    loaded = ddp.load_state_dict(changed)
    assert ddp.params is loaded
    for k, v in ddp.state_dict().items():
        np.testing.assert_array_equal(v, changed[k])
    with pytest.raises(KeyError, match="missing keys.*layer_00/bias"):
        ddp.load_state_dict({k: v for k, v in sd.items() if k != "params/layer_00/bias"})
    with pytest.raises(KeyError, match="unexpected keys.*extra"):
        ddp.load_state_dict({**sd, "extra": np.zeros(1)})
    partial = ddp.load_state_dict({"params/layer_00/bias": sd["params/layer_00/bias"], "extra": 0}, strict=False)
    np.testing.assert_array_equal(np.asarray(partial["params"]["layer_00"]["bias"]), sd["params/layer_00/bias"])
    np.testing.assert_array_equal(np.asarray(partial["params"]["layer_01"]["kernel"]), changed["params/layer_01/kernel"])
    with pytest.raises(ValueError, match="layer_00/kernel has shape"):
        ddp.load_state_dict({**sd, "params/layer_00/kernel": np.zeros((3, 3))})


def test_megatron_loop_example_equals_one_device():
    """examples/megatron_style_loop.py: tp=2 dp=4, distributed optimizer, per-token loss through
    finalize_model_grads([model], num_tokens) vs plain JAX on one device (rtol 1e-5)."""
    import megatron_style_loop

    assert megatron_style_loop.check(tp=2, steps=3) < 1e-5


def test_megatron_loop_tensor_parallel_state_dict_is_layout_free():
    """The tp=2 and tp=1 models start from the same global parameters (Megatron's master init)."""
    import megatron_style_loop

    a, b = megatron_style_loop.initial_params(2), megatron_style_loop.initial_params(1)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_forward_only_and_mean_loss_through_the_schedule():
    """A (loss, dict) loss_func: the schedule divides by num_microbatches, DDP averages over dp;
    forward_only leaves the grad buffers alone."""
    from core.distributed import finalize_model_grads
    from core.pipeline_parallel import get_forward_backward_func

    ddp, opt, module, params, (x, y) = _mlp_ddp()
    sharding = NamedSharding(ddp.mesh, ddp.batch_spec)
    halves = [(x[i::2], y[i::2]) for i in range(2)]

    def data():
        for hx, hy in halves:
            yield tuple(jax.device_put(a, sharding) for a in (hx, hy))

    def forward_step_func(mb, model):
        out = model(mb[0])
        return out, lambda o: (jnp.mean((o - mb[1]) ** 2), {"mse": jnp.mean((o - mb[1]) ** 2)})

    fb = get_forward_backward_func(ddp.state)
    ddp.zero_grad_buffer()
    losses = fb(forward_step_func=forward_step_func, data_iterator=data(), model=ddp, num_microbatches=2,
                forward_only=True)
    assert ddp.num_tokens is None
    want = [float(mse_loss(module)(params, (hx, hy))) for hx, hy in halves]
    np.testing.assert_allclose([float(d["mse"]) for d in losses], want, rtol=1e-5)
    calls = []
    ddp.finalize_model_grads_func = lambda chunks, num_tokens: calls.append(num_tokens) or finalize_model_grads(
        chunks, num_tokens)  # Megatron's config.finalize_model_grads_func, called by the schedule
    fb(forward_step_func=forward_step_func, data_iterator=data(), model=[ddp], num_microbatches=2)
    assert calls == [None]  # a mean loss: no token count
    opt.init_state(params)
    assert opt.step()[0]
    new = ddp.params
    grads = jax.grad(lambda p: sum(mse_loss(module)(p, h) for h in halves) / 2)(params)
    want_params = jax.tree.map(lambda p, g: p - SGD.lr * g, params, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
                 new, want_params)


def test_make_train_step_hands_the_loss_a_key_per_rank_and_microbatch():
    """with_rng: loss_fn(params, microbatch, rng) gets fold_in(fold_in(rng, dp rank), microbatch);
    a dropout model trained that way equals the same keys applied on one device."""
    ddp, opt, module, params, (x, y) = _mlp_ddp()
    m, dp = 2, 8
    per = GLOBAL_BATCH // dp

    def loss_fn(p, mb, rng):
        bx, by = mb
        keep = jax.random.bernoulli(rng, 0.7, by.shape)
        return jnp.mean((module.apply(p, bx) * keep / 0.7 - by) ** 2)

    step = make_train_step(ddp, opt, loss_fn, m, with_rng=True)
    rng = jax.random.key(42)
    new, _, metrics = step(jax.tree.map(jnp.copy, params), opt.init_state(params), ddp.shard_batch((x, y)), rng)

    def reference_loss(p):
        total = 0.0
        for r in range(dp):
            rows = slice(r * per, (r + 1) * per)
            for i in range(m):
                mb = (x[rows][i * per // m:(i + 1) * per // m], y[rows][i * per // m:(i + 1) * per // m])
                total += loss_fn(p, mb, jax.random.fold_in(jax.random.fold_in(rng, r), i))
        return total / (dp * m)

    loss, grads = jax.value_and_grad(reference_loss)(params)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    want = jax.tree.map(lambda p, g: p - SGD.lr * g, params, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7), new, want)
    with pytest.raises(TypeError, match=r"\(params, opt_state, batch, rng\)"):
        step(params, opt.init_state(params), ddp.shard_batch((x, y)))



class _Stage(nn.Module):
    """One pipeline stage: ``tanh(x @ w)``, its weight split over ``"pp"`` (local ``[1, 8, 8]``)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", with_parallel_metadata(nn.initializers.normal(1.0), ("pp", None, None)), (1, 8, 8))
        return jnp.tanh(x @ w[0])


def test_megatron_loop_with_1f1b_on_a_ddp_model():
    """pp=2 x dp=4: get_forward_backward_func picks 1F1B, run on the DDP model's stage params; the
    losses and the SGD step equal the two-layer network on one device."""
    from core.distributed import finalize_model_grads
    from core.pipeline_parallel import forward_backward_pipelining_without_interleaving, get_forward_backward_func

    state = ps.build_parallel_state(pipeline_model_parallel_size=2)
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(use_distributed_optimizer=True), _Stage())
    opt = get_megatron_optimizer(SGD, [ddp])
    params = ddp.init(jax.random.key(0), jnp.ones((2, 8)))
    fb = get_forward_backward_func(state)
    assert fb is forward_backward_pipelining_without_interleaving
    rng = np.random.default_rng(0)
    x, t = rng.normal(size=(4, 16, 8)).astype(np.float32), rng.normal(size=(4, 16, 8)).astype(np.float32)

    def forward_step_func(mb, model):
        return model(mb[0]), lambda y: (jnp.mean((y - mb[1]) ** 2), {"mse": jnp.mean((y - mb[1]) ** 2)})

    ddp.zero_grad_buffer()
    losses = fb(forward_step_func=forward_step_func, data_iterator=iter([ddp.shard_batch((x[i], t[i])) for i in range(4)]),
                model=[ddp], num_microbatches=4)
    finalize_model_grads([ddp])
    opt.step()
    new = ddp.params

    w = np.asarray(params["params"]["w"])  # [2, 8, 8]: stage 0, stage 1
    net = lambda w, xi: jnp.tanh(jnp.tanh(xi @ w[0]) @ w[1])
    want = [float(jnp.mean((net(w, x[i]) - t[i]) ** 2)) for i in range(4)]
    np.testing.assert_allclose([float(d["mse"]) for d in losses], want, rtol=1e-5)
    g = jax.grad(lambda w: sum(jnp.mean((net(w, x[i]) - t[i]) ** 2) for i in range(4)) / 4)(jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(new["params"]["w"]), w - SGD.lr * np.asarray(g), rtol=1e-5, atol=1e-6)
