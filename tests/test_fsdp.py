"""FSDP utilities (xlstm_jax API): a sharded train step equals plain DP and one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ddp_models import make_batch
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.distributed.data_parallel import (
    gather_array_with_mean_grads,
    shard_module_params,
    shard_params,
    sync_gradients,
)
from core.param_metadata import unbox


class _Mlp(nn.Module):
    fsdp: bool
    min_weight_size: int = 64

    @nn.compact
    def __call__(self, x):
        dense = shard_module_params(nn.Dense, "dp", self.min_weight_size) if self.fsdp else nn.Dense
        x = jnp.tanh(dense(32, name="l0")(x))
        x = jnp.tanh(dense(24, name="l1")(x))
        return dense(4, name="l2")(x)


def _train(fsdp: bool, steps=3, lr=0.1):
    state = ps.build_parallel_state()
    mesh = state.mesh
    model = _Mlp(fsdp)
    x, _ = make_batch(32)
    init = lambda r, v: model.init(r, v)
    boxed = jax.eval_shape(jax.shard_map(init, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False),
                           jax.random.key(0), x[:4])
    specs = nn.get_partition_spec(boxed)
    params = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=(P(), P()), out_specs=specs, check_vma=False))(
        jax.random.key(0), jnp.asarray(x[:4]))

    def step(params, batch):
        bx, by = batch
        loss = lambda p: jnp.mean((model.apply(p, bx) - by) ** 2)
        grads = sync_gradients(jax.grad(loss)(params), ("dp",))
        return jax.tree.map(lambda p, g: p - lr * g, params, grads)

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P("dp")), out_specs=specs, check_vma=False))
    for i in range(steps):
        params = step(params, tuple(map(jnp.asarray, make_batch(32, seed=i))))
    return boxed, params


def test_fsdp_step_equals_data_parallel_and_single_device():
    boxed, fsdp_params = _train(fsdp=True)
    # The kernels (> 64 elements) are sharded over dp along their largest divisible dim.
    names = {k: v["kernel"].names for k, v in boxed["params"].items()}
    assert names == {"l0": (None, "dp"), "l1": ("dp", None), "l2": ("dp", None)}
    assert not isinstance(boxed["params"]["l2"]["bias"], nn.Partitioned)
    _, dp_params = _train(fsdp=False)
    fsdp_plain = unbox(fsdp_params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 fsdp_plain, dp_params)
    # Single device, global batch.
    model = _Mlp(False)
    params = model.init(jax.random.key(0), jnp.asarray(make_batch(32)[0][:4]))
    for i in range(3):
        bx, by = map(jnp.asarray, make_batch(32, seed=i))
        g = jax.grad(lambda p: jnp.mean((model.apply(p, bx) - by) ** 2))(params)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, g)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 fsdp_plain, params)


@pytest.mark.parametrize("gather_dtype,grad_dtype", [(None, None), (jnp.bfloat16, jnp.bfloat16)])
def test_gather_with_mean_grads_dtypes(gather_dtype, grad_dtype):
    state = ps.build_parallel_state()
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)

    def body(v):
        out, vjp = jax.vjp(lambda v: gather_array_with_mean_grads(v, 0, "dp", gather_dtype, grad_dtype), v)
        (g,) = vjp((jnp.ones(out.shape) * (1 + lax_rank())).astype(out.dtype))
        return out[None], g

    lax_rank = lambda: jax.lax.axis_index("dp").astype(jnp.float32)
    out, g = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=P("dp"), out_specs=(P("dp"), P("dp")),
                                   check_vma=False))(x)
    assert out.dtype == (gather_dtype or jnp.float32) and g.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out, np.float32)[0], x)
    np.testing.assert_allclose(np.asarray(g), np.full((8, 4), np.mean(np.arange(1, 9))), rtol=1e-2)


def test_shard_params_skips_small_and_indivisible():
    state = ps.build_parallel_state()
    params = {"big": jnp.ones((6, 16)), "small": jnp.ones((4,)), "odd": jnp.ones((7, 9))}

    shapes = jax.eval_shape(jax.shard_map(lambda p: jax.tree.map(jnp.shape, shard_params(p, "dp", 10)),
                                          mesh=state.mesh, in_specs=P(), out_specs=P(), check_vma=False), params)
    assert isinstance(shapes["big"], nn.Partitioned) and shapes["big"].names == (None, "dp")
    assert not isinstance(shapes["small"], nn.Partitioned) and not isinstance(shapes["odd"], nn.Partitioned)
